// Package session is pathtrace's reusable tracer core: built from Options, run
// under a context, it discovers the node, attaches the observers and taps, feeds
// every observation to the verdict engine and returns a report. The CLI, the
// incident command and a daemon all drive the same Session; nothing here is
// package-level, so two sessions can run side by side in one process.
package session

import (
	"github.com/pathtrace/pathtrace/internal/cgroup2"

	"context"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
	"github.com/pathtrace/pathtrace/internal/probe"
	"golang.org/x/net/bpf"
)

// Options say what to trace and for how long.
type Options struct {
	Services []flow.Service
	Duration time.Duration // 0 = until the context ends
	Discover discover.Options
	Snaplen  int
	MaxFlows int
	// Ready, when set, is called once every observer and tap is in place: a
	// caller that generates traffic waits for it.
	Ready func(*discover.NodeInfo, []probe.Attachment)
	// Progress, when set, is called about once a second while tracing.
	Progress func(Progress)
}

// Progress is a live view of a running session.
type Progress struct {
	Elapsed, Duration time.Duration
	Summary           flow.Summary
	Packets           map[string]uint64 // per capture point
	Drops             map[string]uint64
}

// Result is everything a session learned.
type Result struct {
	Node        *discover.NodeInfo
	Attachments []probe.Attachment
	Flows       []flow.Flow
	Summary     flow.Summary
	Drops       map[string]uint64
	Packets     map[string]uint64
	StopReason  string
}

// tap is one capture point with its role label ("pod:eth0", "uplink:bond0").
type tap struct {
	label string
	point obs.Point
	t     *capture.Tap
	// classic: the tap filters with a classic BPF program of the watched
	// addresses, which widen() must replace as backends are learned. The
	// eBPF filter reads the probe's maps and follows by itself.
	classic bool
}

// Run traces until the duration elapses or ctx ends, then returns the report.
// Errors that are the user's fault are *discover.UsageError.
func Run(ctx context.Context, opt Options) (*Result, error) {
	if len(opt.Services) == 0 {
		return nil, &discover.UsageError{Msg: "no Service to trace: give --svc IP[:PORT][/tcp|udp]"}
	}
	if opt.Snaplen <= 0 {
		opt.Snaplen = 96
	}
	for _, s := range opt.Services {
		opt.Discover.Services = append(opt.Discover.Services, s.Addr)
	}

	pr, err := probe.New()
	if err != nil {
		return nil, fmt.Errorf("load observers: %w", err)
	}
	defer pr.Close()
	opt.Discover.OwnPrograms = pr.OwnProgramIDs

	node, err := discover.Node(ctx, opt.Discover)
	if err != nil {
		return nil, err
	}

	watch := initialWatch(opt.Services, node)
	if err := pr.Watch(watch...); err != nil {
		return nil, fmt.Errorf("watch addresses: %w", err)
	}

	cgroup := opt.Discover.Cgroup
	if cgroup == "" {
		if cgroup, err = cgroup2.Root(); err != nil {
			return nil, err
		}
	}
	atts := attachObservers(pr, node, cgroup)
	atts = append(atts, probe.KernelFunctionProbes()...)

	tapProg, tapProgErr := pr.TapFilter(opt.Snaplen) // owned by pr
	taps, tapAtts := openTaps(node, watch, opt.Snaplen, tapProg, tapProgErr)
	atts = append(atts, tapAtts...)
	defer func() {
		for _, tp := range taps {
			tp.t.Close()
		}
	}()

	eng := flow.NewEngine(flow.Config{
		Services:    opt.Services,
		Points:      activePoints(atts),
		Attribution: attribution(node),
		MaxFlows:    opt.MaxFlows,
	})

	if opt.Ready != nil {
		opt.Ready(node, atts)
	}

	root, err := cgroup2.Root()
	if err != nil {
		root = cgroup
	}
	tr := &tracer{opt: opt, pr: pr, taps: taps, eng: eng, watch: watch, cgroupRoot: root, scope: netnsScope(node)}
	res := &Result{Node: node, Attachments: atts}
	res.StopReason = tr.run(ctx)
	tr.attributeCgroups()
	discover.RefreshGatewayMACs(node)
	eng.SetGatewayMACs(gatewayMACs(node))

	res.Flows = eng.Flows()
	res.Summary = eng.Summary()
	res.Packets, res.Drops = tr.counters()
	return res, nil
}

// tracer is one running session's moving parts.
type tracer struct {
	opt        Options
	pr         *probe.Probe
	taps       []tap
	eng        *flow.Engine
	watch      []netip.Addr
	cgroupRoot string
	cgroupDone map[uint64]bool
	// filterErrors counts failed widenings (watch list or tap filter
	// updates): each one may lose the packets of a learned backend.
	filterErrors uint64
	// scope is the netns inodes of the traced Pods and the node: the socket
	// observers are host-wide and would also report other netns' clients.
	scope      map[uint64]bool
	outOfScope uint64
}

// netnsScope is the set of network namespaces whose sockets are traced.
func netnsScope(node *discover.NodeInfo) map[uint64]bool {
	scope := map[uint64]bool{node.HostNetNS.Inode: true}
	for _, p := range node.Pods {
		scope[p.NetNS.Inode] = true
	}
	return scope
}

// add feeds the engine one observation that is within scope.
func (tr *tracer) add(o obs.Observation) {
	switch o.Point {
	case obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
		if o.NetNS != 0 && !tr.scope[o.NetNS] {
			tr.outOfScope++
			return
		}
	}
	tr.eng.Add(o)
}

// run feeds every producer into the engine until the bound or ctx ends and
// says why it stopped.
func (tr *tracer) run(ctx context.Context) string {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := "interrupted"
	var timer <-chan time.Time
	if tr.opt.Duration > 0 {
		t := time.NewTimer(tr.opt.Duration)
		defer t.Stop()
		timer = t.C
	}

	// One consumer owns the engine; producers block when it lags, so the kernel
	// (ring full) counts what is lost instead of this process dropping silently.
	observations := make(chan obs.Observation, 4096)
	var producers sync.WaitGroup
	producers.Add(1)
	go func() {
		defer producers.Done()
		_ = tr.pr.Run(runCtx, func(o obs.Observation) { send(runCtx, observations, o) })
	}()
	for _, tp := range tr.taps {
		producers.Add(1)
		go func(tp tap) {
			defer producers.Done()
			_ = tp.t.Run(runCtx, func(p *capture.Packet) {
				if o, ok := p.Observation(tp.point); ok {
					o.Ifname = tp.label
					send(runCtx, observations, o)
				}
			})
		}(tp)
	}
	go func() { producers.Wait(); close(observations) }()

	start := time.Now()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
loop:
	for {
		select {
		case o, ok := <-observations:
			if !ok {
				break loop
			}
			tr.add(o)
		case <-tick.C:
			tr.widen()
			tr.attributeCgroups()
			if tr.opt.Progress != nil {
				p := Progress{Elapsed: time.Since(start), Duration: tr.opt.Duration, Summary: tr.eng.Summary()}
				p.Packets, p.Drops = tr.counters()
				tr.opt.Progress(p)
			}
		case <-timer:
			stop = "duration"
			break loop
		case <-ctx.Done():
			break loop
		}
	}
	// Let in-flight events land, then drain what the producers still hold.
	time.Sleep(200 * time.Millisecond)
	cancel()
	for o := range observations {
		tr.add(o)
	}
	return stop
}

// attributeCgroups resolves the client cgroups seen on flows to the sock_addr
// programs effective there, for "by" of socket-layer rewrites.
func (tr *tracer) attributeCgroups() {
	if tr.cgroupDone == nil {
		tr.cgroupDone = map[uint64]bool{}
	}
	for _, id := range tr.eng.CgroupIDs() {
		if tr.cgroupDone[id] {
			continue
		}
		tr.cgroupDone[id] = true
		_, progs, err := discover.SockProgramsForCgroupID(tr.cgroupRoot, id, tr.pr.OwnProgramIDs)
		if err != nil {
			continue // the node-wide list from discovery stays the attribution
		}
		fps := make([]flow.SockProgram, len(progs))
		for i, p := range progs {
			fps[i] = flow.SockProgram{AttachType: p.Attach, Name: p.Name, ID: uint32(p.ID), Cgroup: p.Cgroup}
		}
		tr.eng.SetCgroupSockPrograms(id, fps)
	}
}

func send(ctx context.Context, ch chan<- obs.Observation, o obs.Observation) {
	select {
	case ch <- o:
	case <-ctx.Done():
	}
}

// widen adds the backends the engine learned to the observers' watch list
// (which the eBPF tap filter shares) and to the classic tap filters, so
// post-rewrite packets are captured too. The observers already learn most
// of this in the kernel; widen covers what they could not (e.g. a backend
// only conntrack named). Failures are counted, never ignored.
func (tr *tracer) widen() {
	seen := make(map[netip.Addr]bool, len(tr.watch))
	for _, a := range tr.watch {
		seen[a] = true
	}
	var added []netip.Addr
	for _, b := range tr.eng.Backends() {
		if !seen[b] {
			seen[b] = true
			added = append(added, b)
		}
	}
	if len(added) == 0 {
		return
	}
	tr.watch = append(tr.watch, added...)
	if err := tr.pr.Watch(added...); err != nil {
		tr.filterErrors++
	}
	var f []bpf.RawInstruction
	var ferr error
	for _, tp := range tr.taps {
		if !tp.classic {
			continue
		}
		if f == nil && ferr == nil {
			f, ferr = capture.FilterFor(tr.watch, tr.opt.Snaplen)
		}
		if ferr != nil || tp.t.SetFilter(f) != nil {
			tr.filterErrors++
		}
	}
}

// initialWatch is the VIPs plus every backend the node's NAT rules name.
func initialWatch(svcs []flow.Service, node *discover.NodeInfo) []netip.Addr {
	seen := map[netip.Addr]bool{}
	var out []netip.Addr
	add := func(a netip.Addr) {
		if a.IsValid() && !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	}
	for _, s := range svcs {
		add(s.Addr)
	}
	for _, r := range node.Netfilter.Rules {
		add(r.Backend.Addr())
	}
	for _, s := range node.IPVS.Services {
		for _, b := range s.Backends {
			add(b.Addr())
		}
	}
	return out
}
