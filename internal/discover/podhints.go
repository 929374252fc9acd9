package discover

import (
	"context"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A CNI plugin makes a Pod's veth in the node's netns, then configures the
// Pod's netns (addresses, routes) within a few seconds at most, and the
// kubelet starts its containers right after: a Pod found only by the
// periodic look (every few seconds, then once more once its netns is set
// up) missed its first connections. So a veth that appears makes the watch
// look every hintEvery for hintFor, which covers that set-up.
const (
	hintEvery = 250 * time.Millisecond
	hintFor   = 5 * time.Second
	// hintRetry is the wait before subscribing again once the kernel's
	// link notifications ended (a full receive buffer ends them).
	hintRetry = time.Second
)

// Hints returns a channel that tells when to Look before the next periodic
// look: every hintEvery for hintFor after a veth (or netkit) appeared or
// changed in the node's netns. Without the kernel's link notifications
// (the netns cannot be entered), nothing is told and the periodic looks
// stay. It ends with ctx.
func (w *PodWatch) Hints(ctx context.Context) <-chan struct{} {
	hints := make(chan struct{}, 1)
	go func() {
		ns, err := netns.GetFromPath(w.hostPath)
		if err != nil {
			return
		}
		defer ns.Close()
		tell := func() {
			if ctx.Err() != nil {
				return // a select that found ctx done and a tick or an update ready may take either
			}
			select {
			case hints <- struct{}{}:
			default: // one is waiting already
			}
		}
		var (
			updates <-chan netlink.LinkUpdate
			retry   <-chan time.Time
			until   time.Time
		)
		every := time.NewTicker(hintEvery)
		every.Stop()
		defer every.Stop()
		// end closes the socket of the subscription made last (its
		// notifications ended, or ctx did): one that ended is not left
		// open, with its goroutine, until ctx ends (a run until stopped
		// subscribes again at each overflow).
		end := func() {}
		subscribe := func() {
			ch := make(chan netlink.LinkUpdate, 64)
			done := make(chan struct{})
			end = sync.OnceFunc(func() { close(done) })
			if err := linkSubscribe(ch, done, netlink.LinkSubscribeOptions{Namespace: &ns}); err != nil {
				end()
				updates, retry = nil, time.After(hintRetry)
				return
			}
			updates, retry = ch, nil
		}
		subscribe()
		for {
			select {
			case <-ctx.Done():
				end()
				if updates != nil {
					go drain(updates) // its reader closes it once its socket is closed
				}
				return
			case <-retry:
				subscribe()
			case u, ok := <-updates:
				if !ok {
					end()
					updates, retry = nil, time.After(hintRetry)
					continue
				}
				if u.Header.Type != unix.RTM_NEWLINK || !isVeth(u.Link) {
					continue
				}
				if time.Now().After(until) {
					every.Reset(hintEvery)
				}
				until = time.Now().Add(hintFor)
				tell()
			case now := <-every.C:
				if now.After(until) {
					every.Stop()
					continue
				}
				tell()
			}
		}
	}()
	return hints
}

// linkSubscribe subscribes to the link notifications of a netns until done
// is closed (a test's stand-in tells when it is).
var linkSubscribe = netlink.LinkSubscribeWithOptions

func drain(updates <-chan netlink.LinkUpdate) {
	for range updates {
	}
}
