package discover

import (
	"context"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// TestPodWatchHintsEndedSubscriptionClosed: a subscription whose
// notifications ended (a full receive buffer ends them) is closed when the
// watch subscribes again, not left open with its goroutine until the run
// ends: a run until stopped subscribed anew at each overflow and kept
// every socket before. The last one is closed with the context.
func TestPodWatchHintsEndedSubscriptionClosed(t *testing.T) {
	subscribed := make(chan (<-chan struct{}), 2)
	calls := 0
	linkSubscribe = func(ch chan<- netlink.LinkUpdate, done <-chan struct{}, _ netlink.LinkSubscribeOptions) error {
		calls++
		if calls == 1 {
			close(ch) // its notifications ended at once
		}
		subscribed <- done
		return nil
	}
	t.Cleanup(func() { linkSubscribe = netlink.LinkSubscribeWithOptions })
	w := &PodWatch{hostPath: "/proc/self/ns/net"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w.Hints(ctx)
	var dones []<-chan struct{}
	for len(dones) < 2 {
		select {
		case d := <-subscribed:
			dones = append(dones, d)
		case <-time.After(30 * time.Second):
			t.Fatalf("%d subscriptions within 30 s, want 2: the watch subscribes again after hintRetry (%s)", len(dones), hintRetry)
		}
	}
	select {
	case <-dones[0]:
	default:
		t.Error("the subscription that ended is still open once the watch subscribed again")
	}
	cancel()
	select {
	case <-dones[1]:
	case <-time.After(30 * time.Second):
		t.Error("the last subscription still open 30 s after the context ended")
	}
}
