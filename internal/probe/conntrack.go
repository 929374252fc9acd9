package probe

import (
	"fmt"
	"net/netip"
	"os"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// ctReadBuffer is the netlink receive buffer of a conntrack subscription: a
// burst of new connections must not overflow it (ENOBUFS loses events).
const ctReadBuffer = 4 << 20

// ctSubscription follows conntrack NEW and UPDATE events of one netns. A
// listening conntrack connection cannot dump; it only listens.
type ctSubscription struct {
	netnsPath string
	netns     uint64
	quit      chan struct{}
	done      chan struct{}
}

// AttachConntrack subscribes to conntrack NEW and UPDATE events in the netns
// at netnsPath ("" = own) and reports entries whose original destination is
// watched, with the reply source as NATDst when it differs (DNAT: the
// backend). Conntrack only reports connections it tracks: something in that
// netns (NAT or stateful rules) must have enabled it.
func (p *Probe) AttachConntrack(netnsPath string) []Attachment {
	a := Attachment{Observer: "conntrack events (new, update)", Where: netnsLabel(netnsPath), Point: obs.PointConntrack}
	netns, err := netnsInode(netnsPath)
	if err != nil {
		a.Err = err
		return []Attachment{a}
	}
	conn, events, errs, err := listenConntrack(netnsPath)
	if err != nil {
		a.Err = err
		return []Attachment{a}
	}
	sub := &ctSubscription{netnsPath: netnsPath, netns: netns, quit: make(chan struct{}), done: make(chan struct{})}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		closeConntrack(conn, events, errs)
		a.Err = fmt.Errorf("probe closed")
		return []Attachment{a}
	}
	p.ctSubs = append(p.ctSubs, sub)
	go p.followConntrack(sub, conn, events, errs)
	return []Attachment{a}
}

func listenConntrack(netnsPath string) (*conntrack.Conn, chan conntrack.Event, chan error, error) {
	cfg := &netlink.Config{}
	if netnsPath != "" {
		ns, err := os.Open(netnsPath)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("open netns %s: %w", netnsPath, err)
		}
		defer ns.Close()
		cfg.NetNS = int(ns.Fd())
	}
	conn, err := conntrack.Dial(cfg)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("dial conntrack netlink: %w", err)
	}
	if err := conn.SetReadBuffer(ctReadBuffer); err != nil {
		conn.Close()
		return nil, nil, nil, fmt.Errorf("conntrack read buffer: %w", err)
	}
	events := make(chan conntrack.Event, 1024)
	errs, err := conn.Listen(events, 1, []netfilter.NetlinkGroup{netfilter.GroupCTNew, netfilter.GroupCTUpdate})
	if err != nil {
		conn.Close()
		return nil, nil, nil, fmt.Errorf("listen to conntrack events: %w", err)
	}
	return conn, events, errs, nil
}

// closeConntrack closes a listening connection. Close waits for the worker,
// which may be blocked handing over an event or an error: keep draining.
func closeConntrack(conn *conntrack.Conn, events chan conntrack.Event, errs chan error) {
	closed := make(chan struct{})
	go func() {
		conn.Close()
		close(closed)
	}()
	for {
		select {
		case <-events:
		case <-errs:
		case <-closed:
			return
		}
	}
}

// followConntrack turns events into observations for Run until stopped. A
// receive error (ENOBUFS when events were lost) is counted and the
// subscription opened again.
func (p *Probe) followConntrack(sub *ctSubscription, conn *conntrack.Conn, events chan conntrack.Event, errs chan error) {
	defer close(sub.done)
	for {
		select {
		case ev := <-events:
			if ev.Flow == nil || !p.isWatched(ev.Flow.TupleOrig.IP.DestinationAddress) {
				continue
			}
			select {
			case p.ctObs <- conntrackObservation(*ev.Flow, sub.netns, time.Now()):
			default:
				p.counters.ctDrops.Add(1)
			}
		case <-errs:
			p.counters.ctErrors.Add(1)
			closeConntrack(conn, events, errs)
			var err error
			if conn, events, errs, err = listenConntrack(sub.netnsPath); err != nil {
				return
			}
		case <-sub.quit:
			closeConntrack(conn, events, errs)
			return
		}
	}
}

func (s *ctSubscription) stop() {
	close(s.quit)
	<-s.done
}

// conntrackObservation describes a conntrack entry: Dst is the original
// destination, NATDst the reply source when it differs from Dst (the backend
// a DNAT chose), NATSrc the reply destination when it differs from Src (the
// address and port a SNAT gave the flow).
func conntrackObservation(f conntrack.Flow, netns uint64, now time.Time) obs.Observation {
	orig, reply := f.TupleOrig, f.TupleReply
	o := obs.Observation{
		Time:     now,
		Point:    obs.PointConntrack,
		Proto:    obs.Proto(orig.Proto.Protocol),
		Src:      netip.AddrPortFrom(orig.IP.SourceAddress.Unmap(), orig.Proto.SourcePort),
		Dst:      netip.AddrPortFrom(orig.IP.DestinationAddress.Unmap(), orig.Proto.DestinationPort),
		NetNS:    netns,
		CTMark:   f.Mark,
		CTStatus: uint32(f.Status),
	}
	back := netip.AddrPortFrom(reply.IP.SourceAddress.Unmap(), reply.Proto.SourcePort)
	if back.Addr().IsValid() && back != o.Dst {
		o.NATDst = back
	}
	if snat := netip.AddrPortFrom(reply.IP.DestinationAddress.Unmap(), reply.Proto.DestinationPort); snat.Addr().IsValid() && snat != o.Src {
		o.NATSrc = snat
	}
	return o
}
