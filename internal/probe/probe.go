// Package probe loads and attaches pathtrace's kernel observers (socket, tc and
// netfilter brackets, conntrack events) and turns what they see into
// obs.Observations. Observers never change a packet or an address and never
// end a chain. Every attachment is a bpf_link or a socket owned by the
// process, so nothing outlives it, and nothing is pinned.
//
// One Probe is one session: it owns its maps, programs, links and sockets,
// and several Probes can run side by side in one process.
package probe

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// Attachment reports one observer: attached (Err == nil) or not, and why.
// A failed attachment is reported, never fatal on its own.
type Attachment struct {
	Observer string // what observes, e.g. "cgroup/connect4", "tcx ingress head"
	Where    string // where it is attached
	Point    obs.Point
	Dir      obs.Dir  // tc observers
	Hook     obs.Hook // netfilter observers
	Prio     int32    // netfilter observers: the priority obtained
	Err      error
	Note     string
}

// Stats counts what a Probe saw and what it lost. Losses are never hidden.
type Stats struct {
	Events          uint64               // ring-buffer records turned into observations
	RingbufLosses   uint64               // events the kernel could not reserve room for
	LossesByPoint   map[obs.Point]uint64 // RingbufLosses by observation point
	DecodeErrors    uint64               // malformed ring-buffer records
	ConntrackEvents uint64               // conntrack observations emitted
	ConntrackErrors uint64               // netlink receive errors (ENOBUFS: events lost)
	ConntrackDrops  uint64               // conntrack observations dropped: reader behind
	LearnErrors     uint64               // in-kernel learning refused (watch_addrs full) or undone (a socket's watch replaced before its first packet)
	// Summarized counts packets the tc and netfilter observers did not report
	// because their flow direction had already been reported PT_EVENTS_PER_FLOW
	// times at that point (the taps still capture them): not a loss; and
	// the drops the drop observer did not report past that budget.
	Summarized uint64
}

// Names of the maps the observer families share; each is created once per
// Probe and handed to every family that uses it. watch_addrs and
// watch_clients are also written by the observers themselves: what they learn
// about a flow in the kernel reaches every later point, the taps' filter
// included, before the flow's next packet does.
var sharedMaps = []string{"events", "ringbuf_losses", "watch_addrs", "watch_endpoints", "watch_clients", "learn_errors",
	"watch_cookies_0", "watch_cookies_1", "watch_cookies_2", "watch_cookies_3", "flow_events_0", "flow_events_1", "flow_events_2", "flow_events_3", "events_summarized", "read_requested",
	"watch_bits_user", "watch_bits_kernel",
	"reader_asleep", "submit_fence", "last_to_watched", "sent_to", "sent_again", "scope_netns"}

// Probe owns every map, program, link and socket of one session.
type Probe struct {
	sockSpec, tcSpec, nfSpec, pktSpec, dropSpec *ebpf.CollectionSpec

	mu      sync.Mutex
	closed  bool
	maps    map[string]*ebpf.Map
	progs   map[string]*ebpf.Program
	progIDs []ebpf.ProgramID
	// kinds are the (type, name) of every observer program pathtrace has,
	// to tell the observers of another pathtrace on the node from the
	// node's own programs.
	kinds    map[programKind]bool
	foreign  map[ebpf.ProgramID]bool // another pathtrace's observers seen
	links    []link.Link
	globals  map[string]bool // host-wide observers attached once per Probe
	watched  map[netip.Addr]bool
	userBits [addrSlots * 2 / 64]uint64 // watch_bits_user's value
	ifnames  map[ifaceKey]string
	// tcLinks are the tcx observers' links by interface (ForgetTC).
	tcLinks  map[ifaceKey][]link.Link
	nfPrios  map[nfKey]int32
	ctSubs   []*ctSubscription
	ctObs    chan obs.Observation // conntrack observations waiting for Run
	modules  kmod.Host            // where AttachConntrack looks for its modules
	closing  chan struct{}
	runWG    sync.WaitGroup
	running  atomic.Bool
	counters counters
	catchUp  catchUp
	drops    dropNames
}

type programKind struct {
	typ  ebpf.ProgramType
	name string
}

type counters struct {
	events, decodeErrors, ctEvents, ctErrors, ctDrops atomic.Uint64
}

type ifaceKey struct {
	netns   uint64
	ifindex int
}

type nfKey struct {
	netns uint64
	hook  obs.Hook
	point obs.Point
}

// New parses the observer objects and creates the shared maps (ring buffer of
// 4 MiB, loss counters, watched addresses). Nothing is attached yet.
func New() (*Probe, error) {
	p := &Probe{
		maps:    map[string]*ebpf.Map{},
		progs:   map[string]*ebpf.Program{},
		globals: map[string]bool{},
		watched: map[netip.Addr]bool{},
		ifnames: map[ifaceKey]string{},
		tcLinks: map[ifaceKey][]link.Link{},
		nfPrios: map[nfKey]int32{},
		ctObs:   make(chan obs.Observation, 4096),
		closing: make(chan struct{}),
		modules: kmod.System,
	}
	var err error
	if p.sockSpec, err = loadObserveSock(); err != nil {
		return nil, fmt.Errorf("parse socket observers: %w", err)
	}
	if p.tcSpec, err = loadObserveTC(); err != nil {
		return nil, fmt.Errorf("parse tc observers: %w", err)
	}
	if p.nfSpec, err = loadObserveNF(); err != nil {
		return nil, fmt.Errorf("parse netfilter observers: %w", err)
	}
	if p.pktSpec, err = loadObservePkt(); err != nil {
		return nil, fmt.Errorf("parse tap filter: %w", err)
	}
	if p.dropSpec, err = loadObserveDrop(); err != nil {
		return nil, fmt.Errorf("parse drop observer: %w", err)
	}
	p.kinds, p.foreign = map[programKind]bool{}, map[ebpf.ProgramID]bool{}
	for _, spec := range []*ebpf.CollectionSpec{p.sockSpec, p.tcSpec, p.nfSpec, p.pktSpec, p.dropSpec} {
		for name, ps := range spec.Programs {
			p.kinds[programKind{ps.Type, name}] = true
		}
	}
	// The socket object declares every shared map.
	for _, name := range sharedMaps {
		m, err := ebpf.NewMap(p.sockSpec.Maps[name])
		if err != nil {
			p.Close()
			return nil, fmt.Errorf("create map %s: %w", name, err)
		}
		p.maps[name] = m
	}
	if err := p.ReadRequested(true); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// ReadRequested tells the socket observers whether to read the destination
// the application requested from the syscall's arguments: needed only while
// another sock_addr program (a socket LB) may have rewritten the one they
// see; otherwise both are the same and the read is saved. On by default.
func (p *Probe) ReadRequested(on bool) error {
	v := uint32(0)
	if on {
		v = 1
	}
	if err := p.maps["read_requested"].Put(uint32(0), v); err != nil {
		return fmt.Errorf("socket observers: set read_requested: %w", err)
	}
	return nil
}

// Scope adds network namespaces (inodes) to those whose sockets the socket
// observers learn from (the clients and backends they teach the other
// points, the taps' filter included); before the first call, every netns's.
// Their events are reported whatever the netns.
func (p *Probe) Scope(inodes ...uint64) error {
	for _, ino := range append([]uint64{0}, inodes...) { // 0: the scope is set
		if err := p.maps["scope_netns"].Put(uint32(ino), uint8(1)); err != nil {
			return fmt.Errorf("socket observers: scope netns %d: %w", ino, err)
		}
	}
	return nil
}

// Unscope takes a netns (inode) out of Scope's: its Pod went, and the
// kernel gives the inode to the next netns made.
func (p *Probe) Unscope(inode uint64) error {
	if err := p.maps["scope_netns"].Delete(uint32(inode)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("socket observers: unscope netns %d: %w", inode, err)
	}
	return nil
}

// Watch adds IPv4 addresses (Service VIPs, backends known without their
// port) to the set whose traffic the observers report, on every port. It
// can be called while the Probe runs.
func (p *Probe) Watch(addrs ...netip.Addr) error {
	ws := make([]obs.Watch, len(addrs))
	for i, a := range addrs {
		ws[i] = obs.WatchAddr(a)
	}
	return p.WatchEndpoints(ws...)
}

// Values of watch_addrs (PT_WATCH_ANY_PORT, PT_WATCH_ENDPOINTS of
// observe.h).
const (
	watchAnyPort   = 1
	watchEndpoints = 2
)

// WatchEndpoints adds what the observers report: every port of an address
// (Port 0), or one endpoint of it (a backend known with the port it serves;
// Proto 0 is TCP and UDP), whose address's other ports stay unobserved
// unless another Watch names them. An address once watched on every port
// stays so. It can be called while the Probe runs.
func (p *Probe) WatchEndpoints(ws ...obs.Watch) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("probe closed")
	}
	added := false
	for _, w := range ws {
		a := w.Addr.Unmap()
		if !a.Is4() {
			return fmt.Errorf("watch %s: only IPv4 addresses are observed", w.Addr)
		}
		// The address's bit first: an observer that finds it clear does
		// not look up the entries it stands for (PT_MAYBE_ANY and
		// PT_MAYBE_ENDS in observe.h).
		maybe := uint64(maybeEnds)
		if w.Port == 0 {
			maybe = maybeAny
		}
		word, bits := addrBits(a.As4(), maybe)
		if p.userBits[word]&bits != bits {
			p.userBits[word] |= bits
			if err := p.maps["watch_bits_user"].Put(uint32(0), &p.userBits); err != nil {
				return fmt.Errorf("watch %s: %w", w, err)
			}
		}
		if w.Port == 0 {
			if err := p.maps["watch_addrs"].Put(a.As4(), uint8(watchAnyPort)); err != nil {
				return fmt.Errorf("watch %s: %w", w, err)
			}
		} else {
			// The endpoints before their address (pt_ct_filter reads
			// the address first); an address watched on every port,
			// by user space or the kernel, is left so.
			for _, proto := range protosOf(w.Proto) {
				k := endpointKey(netip.AddrPortFrom(a, w.Port), proto)
				if err := p.maps["watch_endpoints"].Put(k, uint8(1)); err != nil {
					return fmt.Errorf("watch %s: %w", w, err)
				}
			}
			err := p.maps["watch_addrs"].Update(a.As4(), uint8(watchEndpoints), ebpf.UpdateNoExist)
			if err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
				return fmt.Errorf("watch %s: %w", w, err)
			}
		}
		if !p.watched[a] {
			p.watched[a] = true
			added = true
		}
	}
	// The conntrack subscriptions' classic kernel filters follow the watch
	// list (pt_ct_filter reads watch_addrs).
	if len(p.ctSubs) > 0 && added {
		filter := conntrackFilter(slices.Collect(maps.Keys(p.watched)))
		for _, s := range p.ctSubs {
			if s.prog != nil {
				continue
			}
			if err := s.setFilter(filter); err != nil {
				return fmt.Errorf("conntrack socket filter: %w", err)
			}
		}
	}
	return nil
}

// protosOf are the protocols of an endpoint of protocol proto (0: both).
func protosOf(proto obs.Proto) []obs.Proto {
	if proto == 0 {
		return []obs.Proto{obs.TCP, obs.UDP}
	}
	return []obs.Proto{proto}
}

// endpointKey is struct pt_endpoint as the kernel stores it (the layout of
// struct pt_client).
func endpointKey(ap netip.AddrPort, proto obs.Proto) [8]byte {
	return clientKey(ap, proto)
}

// addrSlots, maybeAny and maybeEnds are PT_ADDR_SLOTS, PT_MAYBE_ANY and
// PT_MAYBE_ENDS of observe.h.
const (
	addrSlots = 1 << 14
	maybeAny  = 1
	maybeEnds = 2
)

// addrBits is the word of watch_bits_user that holds an address's bits and
// the given ones of them (maybeAny, maybeEnds) in it: pt_addr_slot of
// observe.h, on the address as the observers load it from a packet.
func addrBits(a [4]byte, maybe uint64) (word int, bits uint64) {
	slot := mix32(binary.NativeEndian.Uint32(a[:])) & (addrSlots - 1)
	return int(slot / 32), maybe << (slot % 32 * 2)
}

// mix32 is pt_mix of observe.h (lowbias32).
func mix32(x uint32) uint32 {
	x ^= x >> 16
	x *= 0x7feb352d
	x ^= x >> 15
	x *= 0x846ca68b
	x ^= x >> 16
	return x
}

func (p *Probe) isWatched(a netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.watched[a.Unmap()]
}

// program returns the named program, loading it on first use. Callers hold
// p.mu.
func (p *Probe) program(spec *ebpf.CollectionSpec, name string) (*ebpf.Program, error) {
	return p.cachedProgram(spec, name, name)
}

// cachedProgram returns the program kept under key, loading spec's program
// name on first use with only the maps it references, the shared ones
// replaced by this Probe's. Loading one program at a time keeps one
// unsupported program from hiding the others. Callers hold p.mu.
func (p *Probe) cachedProgram(spec *ebpf.CollectionSpec, key, name string) (*ebpf.Program, error) {
	if p.closed {
		return nil, errors.New("probe closed")
	}
	if prog := p.progs[key]; prog != nil {
		return prog, nil
	}
	if spec == nil {
		return nil, errors.New("load " + name + ": the probe no longer loads programs (ReleaseSpecs)")
	}
	replace := map[string]*ebpf.Map{}
	for _, m := range sharedMaps {
		if _, ok := spec.Maps[m]; ok {
			replace[m] = p.maps[m]
		}
	}
	// LoadAndAssign loads what the tagged fields need; build a one-field struct
	// tagged with this program's name.
	holder := reflect.New(reflect.StructOf([]reflect.StructField{{
		Name: "Program",
		Type: reflect.TypeFor[*ebpf.Program](),
		Tag:  reflect.StructTag(`ebpf:"` + name + `"`),
	}}))
	if err := spec.LoadAndAssign(holder.Interface(), &ebpf.CollectionOptions{MapReplacements: replace}); err != nil {
		return nil, fmt.Errorf("load %s: %w", name, err)
	}
	prog := holder.Elem().Field(0).Interface().(*ebpf.Program)
	info, err := prog.Info()
	if err != nil {
		prog.Close()
		return nil, fmt.Errorf("info of %s: %w", name, err)
	}
	id, _ := info.ID()
	p.progs[key] = prog
	p.progIDs = append(p.progIDs, id)
	return prog, nil
}

// ReleaseSpecs drops the parsed objects (their BTF takes megabytes) once
// every observer is loaded: programs loaded so far stay usable, no new one
// can be loaded.
func (p *Probe) ReleaseSpecs() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sockSpec, p.tcSpec, p.nfSpec, p.pktSpec, p.dropSpec = nil, nil, nil, nil, nil
}

// IsObserver tells whether the program with this ID is one of pathtrace's
// observers: this Probe's, or another pathtrace's running on the node (the
// same program type and name). Either way it rewrites nothing and must not
// be named as a rewriter. A program that cannot be read is not one.
func (p *Probe) IsObserver(id ebpf.ProgramID) bool {
	p.mu.Lock()
	own := slices.Contains(p.progIDs, id)
	p.mu.Unlock()
	if own {
		return true
	}
	prog, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return false
	}
	defer prog.Close()
	info, err := prog.Info()
	if err != nil || !p.kinds[programKind{info.Type, info.Name}] {
		return false
	}
	p.mu.Lock()
	p.foreign[id] = true
	p.mu.Unlock()
	return true
}

// ForeignObservers is how many observer programs of another pathtrace
// IsObserver has met: another trace runs on the node (and costs the traced
// system as much again).
func (p *Probe) ForeignObservers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.foreign)
}

// ConntrackLosses is how many conntrack events were lost so far (receive
// errors and drops): Stats' two counters, without its map lookups.
func (p *Probe) ConntrackLosses() uint64 {
	return p.counters.ctErrors.Load() + p.counters.ctDrops.Load()
}

// Stats returns the counters so far.
func (p *Probe) Stats() Stats {
	s := Stats{
		Events:          p.counters.events.Load(),
		DecodeErrors:    p.counters.decodeErrors.Load(),
		ConntrackEvents: p.counters.ctEvents.Load(),
		ConntrackErrors: p.counters.ctErrors.Load(),
		ConntrackDrops:  p.counters.ctDrops.Load(),
		LossesByPoint:   map[obs.Point]uint64{},
	}
	p.mu.Lock()
	losses, learnErrors, summarized := p.maps["ringbuf_losses"], p.maps["learn_errors"], p.maps["events_summarized"]
	p.mu.Unlock()
	if losses == nil || learnErrors == nil || summarized == nil {
		return s
	}
	for key := range uint32(bpfPointCount) {
		s.Summarized += sumPerCPU(summarized, key)
	}
	s.LearnErrors = sumPerCPU(learnErrors, 0)
	for key := range uint32(bpfPointCount) {
		var perCPU []uint64
		if err := losses.Lookup(key, &perCPU); err != nil {
			continue
		}
		for _, n := range perCPU {
			s.RingbufLosses += n
			if pt, ok := bpfPoints[key]; ok && n > 0 {
				s.LossesByPoint[pt] += n
			}
		}
	}
	return s
}

// Detach takes every observer out of the kernel's paths (links closed,
// conntrack subscriptions stopped) and waits for Run to return, but keeps
// the maps: Stats goes on saying what the observers saw and lost while
// they ran. Once nobody reads their ring, observers still attached would
// fill it and count what they could not write as losses, though it came
// after the run. Nothing can be attached or watched afterwards; Close
// releases the rest.
func (p *Probe) Detach() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.closing)
	links, subs := p.links, p.ctSubs
	p.links, p.ctSubs = nil, nil
	clear(p.tcLinks) // closed with links
	p.mu.Unlock()

	var errs []error
	for i := len(links) - 1; i >= 0; i-- {
		if err := links[i].Close(); err != nil {
			errs = append(errs, fmt.Errorf("close link: %w", err))
		}
	}
	for _, s := range subs {
		s.stop()
	}
	p.runWG.Wait()
	return errors.Join(errs...)
}

// Close detaches every observer (Detach) and releases every map, program
// and socket. It waits for Run to return.
func (p *Probe) Close() error {
	errs := []error{p.Detach()}
	p.mu.Lock()
	defer p.mu.Unlock()
	for name, prog := range p.progs {
		if err := prog.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close program %s: %w", name, err))
		}
	}
	for name, m := range p.maps {
		if err := m.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close map %s: %w", name, err))
		}
	}
	p.progs, p.maps = map[string]*ebpf.Program{}, map[string]*ebpf.Map{}
	return errors.Join(errs...)
}

// keep records a link so Close detaches it. Callers hold p.mu.
func (p *Probe) keep(l link.Link) {
	p.links = append(p.links, l)
}

// LearnErrors is Stats().LearnErrors alone, one map read: for a caller
// that asks every second.
func (p *Probe) LearnErrors() uint64 {
	p.mu.Lock()
	m := p.maps["learn_errors"]
	p.mu.Unlock()
	if m == nil {
		return 0
	}
	return sumPerCPU(m, 0)
}

// sumPerCPU adds up every CPU's value of key of a per-CPU array.
func sumPerCPU(m *ebpf.Map, key uint32) uint64 {
	var perCPU []uint64
	if err := m.Lookup(key, &perCPU); err != nil {
		return 0
	}
	var total uint64
	for _, v := range perCPU {
		total += v
	}
	return total
}
