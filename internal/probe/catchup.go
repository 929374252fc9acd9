package probe

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// catchUp lets the consumer of the observations have the ring read at once
// (Probe.CatchUp) while the reader runs.
type catchUp struct {
	mu   sync.Mutex
	ring *ringPositions // nil while no reader runs
	park *ringPark
	asks []chan struct{} // closed once the reader read the ring after them
	// reading is set while the reader holds records it took from the ring
	// and has not handed over yet: the ring looks empty then.
	reading atomic.Bool
}

// CatchUp asks the running reader to read the observers' ring at once. The
// observers run before the packet reaches a tap (a socket's connect and
// first packet, a tc hook on the way), but the reader polls the ring while
// the taps hand over their blocks: a tap's frames can reach the consumer
// before the socket events that preceded them, and flows are linked as
// observations come (a reused port's frames would go to the earlier
// socket's flow; beyond --max-flows, be refused). The channel is closed once
// what the ring held at the call was handed to emit; nil when there is
// nothing to wait for (the ring empty and nothing read but not handed over,
// or no reader running, or no Probe).
func (p *Probe) CatchUp() <-chan struct{} {
	if p == nil {
		return nil
	}
	c := &p.catchUp
	c.mu.Lock()
	defer c.mu.Unlock()
	// The positions first: a reader that emptied the ring set reading
	// before it took the records, and clears it once it handed them over.
	if c.ring == nil || !c.ring.pending() && !c.reading.Load() {
		return nil
	}
	done := make(chan struct{})
	c.asks = append(c.asks, done)
	c.park.poke()
	return done
}

// start is called by the reader as it begins, with its ring and park.
func (c *catchUp) start(ring *ringPositions, park *ringPark) {
	c.mu.Lock()
	c.ring, c.park = ring, park
	c.mu.Unlock()
}

// stop is called by the reader as it ends: no one waits for it any more.
func (c *catchUp) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ring, c.park = nil, nil
	for _, done := range c.asks {
		close(done)
	}
	c.asks = nil
}

// take returns the asks made so far: the reader answers them (answer)
// after reading the ring dry.
func (c *catchUp) take() []chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	asks := c.asks
	c.asks = nil
	return asks
}

// asked tells whether an ask waits for the reader.
func (c *catchUp) asked() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.asks) > 0
}

func answer(asks []chan struct{}) {
	for _, done := range asks {
		close(done)
	}
}

// ringPositions maps the ring buffer's consumer and producer positions
// read-only: whether the observers submitted what the reader has not taken,
// told without the reader (whose own mapping its goroutine alone may use).
type ringPositions struct {
	mem        []byte
	cons, prod *uint64
}

func mapRingPositions(events *ebpf.Map) (*ringPositions, error) {
	page := os.Getpagesize()
	mem, err := unix.Mmap(events.FD(), 0, 2*page, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map the ring buffer's positions: %w", err)
	}
	return &ringPositions{mem: mem, cons: (*uint64)(unsafe.Pointer(&mem[0])), prod: (*uint64)(unsafe.Pointer(&mem[page]))}, nil
}

func (r *ringPositions) pending() bool {
	return atomic.LoadUint64(r.prod) != atomic.LoadUint64(r.cons)
}

func (r *ringPositions) close() { unix.Munmap(r.mem) }
