package discover

import (
	"reflect"
	"testing"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// handleTimeouts are the send and receive timeouts of each socket of h. The
// netlink package keeps them in its sockets, unexported: read by reflection.
func handleTimeouts(t *testing.T, h *netlink.Handle) []time.Duration {
	t.Helper()
	f := reflect.ValueOf(h).Elem().FieldByName("sockets")
	if !f.IsValid() {
		t.Fatal("netlink.Handle has no sockets field any more: update this test")
	}
	socks, ok := reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem().Interface().(map[int]*nl.SocketHandle)
	if !ok || len(socks) == 0 {
		t.Fatalf("netlink.Handle sockets: %s, none read", f.Type())
	}
	var out []time.Duration
	for _, sh := range socks {
		send, recv := sh.Socket.GetTimeouts()
		out = append(out, send, recv)
	}
	return out
}

// TestNodeNetlinkTimeout: the node netns's netlink handle, used all through
// discovery, bounds each request as nsutil.Netlink does: a busy kernel
// never hangs discovery.
func TestNodeNetlinkTimeout(t *testing.T) {
	needRoot(t)
	h, err := openHost(nsutil.Self)
	if err != nil {
		t.Fatal(err)
	}
	defer h.close()
	for _, to := range handleTimeouts(t, h.nl) {
		if to != 5*time.Second {
			t.Errorf("node netlink handle timeouts %v, want 5s each", handleTimeouts(t, h.nl))
			break
		}
	}
}
