package probe

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/mdlayher/netlink"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// ctFilterProgram is the conntrack event socket's eBPF filter.
const ctFilterProgram = "pt_ct_filter"

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

	mu   sync.Mutex
	conn *netlink.Conn // the listening socket, replaced after a failure
	// prog is its eBPF filter (pt_ct_filter), which reads the watch maps
	// the observers learn into; without it (it did not load), filter is its
	// classic one (conntrackFilter), which Watch keeps up to date, nil for
	// none.
	prog   *ebpf.Program
	filter []bpf.RawInstruction
}

// conntrackModulesErr tells why no subscription is made on host h: a module
// it needs is neither loaded nor built in, so subscribing would have the
// kernel load it, and pathtrace never changes the node. Nil when every one
// is there (or the kernel cannot load modules).
func conntrackModulesErr(h kmod.Host) error {
	switch m := h.FirstToLoad(kmod.Conntrack...); m {
	case "":
		return nil
	case "nf_conntrack":
		if nl := h.NotLoaded(m); nl != m+" is not loaded" {
			return fmt.Errorf("unavailable: %s (not subscribed: subscribing would load it, and pathtrace never changes the node)", nl)
		}
		return errors.New("unavailable: nf_conntrack is not loaded, nothing tracks connections on this node (not subscribed: subscribing would load it, and pathtrace never changes the node)")
	default:
		return fmt.Errorf("unavailable: %s (not subscribed: subscribing would load it, and pathtrace never changes the node)", h.NotLoaded(m))
	}
}

// AttachConntrack subscribes to conntrack NEW and UPDATE events in the netns
// at netnsPath ("" = own) and reports entries whose original destination is
// watched, or whose original source is a client endpoint the observers
// learned (a flow a socket LB or tc program rewrote before conntrack saw
// it), with the reply source as NATDst when it differs (DNAT: the backend)
// and the reply destination as NATSrc (SNAT). Conntrack only reports
// connections it tracks: something in that netns (NAT or stateful rules)
// must have enabled it. A socket filter drops the other entries' events in
// the kernel: pt_ct_filter, which reads the observers' maps, or where it
// cannot load a classic one on the watched destinations (Watch keeps it up
// to date).
// Without the conntrack netlink modules already loaded (or built in) it
// subscribes to nothing and says so (conntrackModulesErr): the kernel would
// load them for the subscription.
func (p *Probe) AttachConntrack(netnsPath string) []Attachment {
	a := Attachment{Observer: "conntrack events (new, update)", Where: netnsLabel(netnsPath), Point: obs.PointConntrack}
	if err := conntrackModulesErr(p.modules); err != nil {
		a.Err = err
		return []Attachment{a}
	}
	netns, err := netnsInode(netnsPath)
	if err != nil {
		a.Err = err
		return []Attachment{a}
	}
	p.mu.Lock()
	prog, progErr := p.program(p.pktSpec, ctFilterProgram)
	var filter []bpf.RawInstruction
	if progErr != nil {
		prog, filter = nil, conntrackFilter(slices.Collect(maps.Keys(p.watched)))
	}
	p.mu.Unlock()
	conn, err := listenConntrack(netnsPath, prog, filter)
	if err != nil {
		a.Err = err
		return []Attachment{a}
	}
	sub := &ctSubscription{netnsPath: netnsPath, netns: netns, quit: make(chan struct{}), done: make(chan struct{}), conn: conn, prog: prog, filter: filter}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		conn.Close()
		a.Err = fmt.Errorf("probe closed")
		return []Attachment{a}
	}
	p.ctSubs = append(p.ctSubs, sub)
	switch {
	case prog != nil:
		go p.followConntrack(sub)
		return []Attachment{a}
	case progErr != nil:
		a.Note = fmt.Sprintf("classic kernel filter on the watched destinations (%v): flows a socket LB or tc program rewrote before conntrack are seen once user space watches their backend", progErr)
	}
	// Addresses watched since the filter was made (Watch did not know this
	// subscription yet) join it now.
	if now := conntrackFilter(slices.Collect(maps.Keys(p.watched))); !slices.Equal(now, filter) {
		filter = now
		if err := sub.setFilter(filter); err != nil {
			a.Note = fmt.Sprintf("kernel filter not updated (%v): events of addresses watched since are lost", err)
		}
	}
	go p.followConntrack(sub)
	if filter == nil {
		a.Note = "every event read in user space (too many watched addresses for a kernel filter)"
	}
	return []Attachment{a}
}

// listenConntrack opens a ctnetlink socket in the netns at netnsPath that
// receives NEW and UPDATE events through prog, else through filter (both
// nil: all of them).
func listenConntrack(netnsPath string, prog *ebpf.Program, filter []bpf.RawInstruction) (*netlink.Conn, error) {
	cfg := &netlink.Config{}
	if netnsPath != "" {
		ns, err := os.Open(netnsPath)
		if err != nil {
			return nil, fmt.Errorf("open netns %s: %w", netnsPath, err)
		}
		defer ns.Close()
		cfg.NetNS = int(ns.Fd())
	}
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, cfg)
	if err != nil {
		return nil, fmt.Errorf("dial conntrack netlink: %w", err)
	}
	if err := conn.SetReadBuffer(ctReadBuffer); err != nil {
		conn.Close()
		return nil, fmt.Errorf("conntrack read buffer: %w", err)
	}
	// The filter before the groups: no unfiltered event is ever queued.
	if prog != nil {
		if err := attachSocketProgram(conn, prog); err != nil {
			conn.Close()
			return nil, fmt.Errorf("conntrack socket filter: %w", err)
		}
	} else if filter != nil {
		if err := conn.SetBPF(filter); err != nil {
			conn.Close()
			return nil, fmt.Errorf("conntrack socket filter: %w", err)
		}
	}
	for _, g := range []uint32{unix.NFNLGRP_CONNTRACK_NEW, unix.NFNLGRP_CONNTRACK_UPDATE} {
		if err := conn.JoinGroup(g); err != nil {
			conn.Close()
			return nil, fmt.Errorf("listen to conntrack events: %w", err)
		}
	}
	return conn, nil
}

// attachSocketProgram attaches an eBPF socket filter to conn (SO_ATTACH_BPF).
func attachSocketProgram(conn *netlink.Conn, prog *ebpf.Program) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ATTACH_BPF, prog.FD())
	}); err != nil {
		return err
	}
	return serr
}

// setFilter replaces the classic kernel filter of the subscription's socket.
func (s *ctSubscription) setFilter(filter []bpf.RawInstruction) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.filter = filter
	if filter == nil {
		return s.conn.RemoveBPF()
	}
	return s.conn.SetBPF(filter)
}

// ctReadSize is the buffer one read of a subscription's socket fills: a
// read returns one event message (the kernel sizes each for its entry, a
// few hundred bytes), never more than this.
const ctReadSize = 64 << 10

// followConntrack turns events into observations for Run until stopped. A
// receive error is counted: ENOBUFS (events were lost) leaves the socket
// usable, any other opens the subscription again. Every event is read into
// one buffer and decoded in place (decodeCTEvent): netlink.Conn.Receive and
// conntrack.Event.Unmarshal allocated a few KiB per event, most of what
// pathtrace allocated under connection churn.
func (p *Probe) followConntrack(sub *ctSubscription) {
	defer close(sub.done)
	sub.mu.Lock()
	conn := sub.conn
	sub.mu.Unlock()
	buf := make([]byte, ctReadSize)
	r, err := newCTReader(conn, buf)
	for err == nil {
		var b []byte
		if b, err = r.next(); err != nil {
			select {
			case <-sub.quit:
				return
			default:
			}
			p.counters.ctErrors.Add(1)
			if errors.Is(err, unix.ENOBUFS) {
				err = nil
				continue
			}
			sub.mu.Lock()
			conn.Close()
			select {
			case <-sub.quit:
				// stop came while the error was counted: the socket it
				// closed is this one, and a new one would never be closed,
				// nor this goroutine end (stop waits for it).
				sub.mu.Unlock()
				return
			default:
			}
			conn, err = listenConntrack(sub.netnsPath, sub.prog, sub.filter)
			if err == nil {
				sub.conn = conn
				r, err = newCTReader(conn, buf)
			}
			sub.mu.Unlock()
			continue
		}
		for len(b) > 0 {
			typ, payload, rest, ok := nextCTMessage(b)
			if !ok {
				break
			}
			b = rest
			e, ok := decodeCTEvent(typ, payload)
			if !ok || !p.isWatched(e.orig.dst.Addr()) && (sub.prog == nil || !p.learnedInKernel(e)) {
				continue
			}
			select {
			case p.ctObs <- conntrackObservation(e, sub.netns, time.Now()):
			default:
				p.counters.ctDrops.Add(1)
			}
		}
	}
}

// ctReader reads a subscription socket's events into one buffer.
type ctReader struct {
	rc   syscall.RawConn
	buf  []byte
	n    int
	err  error
	read func(fd uintptr) bool // made once: a closure per read would allocate
}

func newCTReader(conn *netlink.Conn, buf []byte) (*ctReader, error) {
	rc, err := conn.SyscallConn()
	if err != nil {
		return nil, err
	}
	r := &ctReader{rc: rc, buf: buf}
	r.read = func(fd uintptr) bool {
		r.n, r.err = unix.Read(int(fd), r.buf)
		return r.err != unix.EAGAIN
	}
	return r, nil
}

// next waits in Go's poller for the socket's next message (or its close)
// and returns it.
func (r *ctReader) next() ([]byte, error) {
	if err := r.rc.Read(r.read); err != nil {
		return nil, err
	}
	if r.err != nil {
		return nil, r.err
	}
	return r.buf[:r.n], nil
}

// stop closes the socket, which ends followConntrack's Receive.
func (s *ctSubscription) stop() {
	close(s.quit)
	s.mu.Lock()
	s.conn.Close()
	s.mu.Unlock()
	<-s.done
}

// learnedInKernel tells whether the observers learned the original
// destination of a conntrack entry, or its original source as a client
// endpoint: pt_ct_filter passed its event for that (user space may not
// watch them yet).
func (p *Probe) learnedInKernel(e ctEntry) bool {
	var v uint8
	dst, src := unmapped(e.orig.dst), unmapped(e.orig.src)
	if dst.Addr().Is4() && p.maps["watch_addrs"].Lookup(dst.Addr().As4(), &v) == nil {
		// An address the kernel watches on some ports only: the entry's
		// destination port must be one of them (pt_ct_filter's test).
		proto := obs.Proto(e.proto)
		if v != watchEndpoints || dst.Port() == 0 || (proto != obs.TCP && proto != obs.UDP) ||
			p.maps["watch_endpoints"].Lookup(endpointKey(dst, proto), &v) == nil {
			return true
		}
	}
	return src.Addr().Is4() && p.maps["watch_clients"].Lookup(clientKey(src, obs.Proto(e.proto)), &v) == nil
}

// clientKey is struct pt_client as the kernel stores it.
func clientKey(ap netip.AddrPort, proto obs.Proto) [8]byte {
	var k [8]byte
	a := ap.Addr().As4()
	copy(k[:4], a[:])
	binary.BigEndian.PutUint16(k[4:], ap.Port())
	k[6] = byte(proto)
	return k
}

// conntrackObservation describes a conntrack entry: Dst is the original
// destination, NATDst the reply source when it differs from Dst (the backend
// a DNAT chose), NATSrc the reply destination when it differs from Src (the
// address and port a SNAT gave the flow).
func conntrackObservation(e ctEntry, netns uint64, now time.Time) obs.Observation {
	o := obs.Observation{
		Time:     now,
		Point:    obs.PointConntrack,
		Proto:    obs.Proto(e.proto),
		Src:      unmapped(e.orig.src),
		Dst:      unmapped(e.orig.dst),
		NetNS:    netns,
		CTMark:   e.mark,
		CTStatus: e.status,
	}
	if back := unmapped(e.reply.src); back.Addr().IsValid() && back != o.Dst {
		o.NATDst = back
	}
	if snat := unmapped(e.reply.dst); snat.Addr().IsValid() && snat != o.Src {
		o.NATSrc = snat
	}
	return o
}

func unmapped(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
