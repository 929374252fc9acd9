// Package session is pathtrace's reusable tracer core: built from Options, run
// under a context, it discovers the node, attaches the observers and taps, feeds
// every observation to the verdict engine and returns a report. The CLI, the
// incident command and a daemon all drive the same Session; nothing here is
// package-level, so two sessions can run side by side in one process.
package session

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// Options say what to trace and for how long.
type Options struct {
	Services []flow.Service
	Duration time.Duration // 0 = until the context ends
	Discover discover.Options
	Snaplen  int
	// RingBytes is each capture point's kernel ring (0 = capture's default).
	RingBytes int
	MaxFlows  int
	// Finished, when set, makes the run report its flows as they end (a
	// run until stopped, Duration 0): about once a second the engine
	// retires the flows that are over (a TCP connection closed and quiet,
	// any flow idle for FlowTimeout; flow.Engine.Retire) and hands them
	// to Finished, in the consumer's goroutine, then forgets them: MaxFlows
	// bounds the flows open at once, and Result.Flows holds those still
	// open at the end (Result.Summary counts them all).
	Finished    func([]flow.Flow)
	FlowTimeout time.Duration // flow.DefaultFlowTimeout when 0
	// Interval, when set with ReportEvery, is given every ReportEvery the
	// summary so far (every flow, reported or open, as flow.Engine.Summary
	// counts them) with the session's own drops and packets per capture
	// point, and how long its threads waited for a CPU so far (nil: the
	// kernel does not say): a run until stopped says how it goes without
	// ending.
	Interval    func(s flow.Summary, drops, packets map[string]uint64, wait *CPUWait)
	ReportEvery time.Duration
	// Ready, when set, is called once every observer and tap is in place: a
	// caller that generates traffic waits for it.
	Ready func(*discover.NodeInfo, []probe.Attachment)
	// Progress, when set, is called about once a second while tracing.
	Progress func(Progress)
	// Pcap, when set, is where every captured frame is written as pcapng,
	// one interface per capture point ("-" = stdout); PcapLimits bound it and
	// reaching a bound ends the session, unless PcapBoundEndsFileOnly.
	Pcap       string
	PcapLimits export.Limits
	// PcapBoundEndsFileOnly makes a reached PcapLimits bound end the file,
	// not the session: the run goes on correlating flows, and the frames
	// captured from then on are counted (export.Summary.FramesNotWritten).
	// An incident sets it: its verdicts must cover the whole run, whatever
	// room its budget leaves the capture.
	PcapBoundEndsFileOnly bool
	// CaptureStart, when set, is called once as the capture starts, after
	// the memory the observers' loading used was given back: a caller that
	// owns the process may tune its heap for the capture then.
	CaptureStart func()
	// CaptureDone, when set, is called once the capture is over, before
	// the report is built: a caller that owns the process may tighten its
	// heap then. The session changes no process-wide setting itself:
	// another session of the process may still be capturing.
	CaptureDone func()
	// CaptureBehind, when set, is called from the taps' goroutines, again
	// and again while the capture is behind its traffic (and loses frames
	// if that goes on): after each block a tap reads while its kernel ring
	// holds a quarter of its blocks not read yet (capture.Config.Behind),
	// and every 10 ms a tap's batch waits on the consumer's full queue. A
	// caller that owns the process may give it more CPU then, and take it
	// back once the calls have stopped for a while.
	CaptureBehind func()
}

// Progress is a live view of a running session.
type Progress struct {
	Elapsed, Duration time.Duration
	Summary           flow.Summary
	// Pending counts the flows of Summary's unknown that may still be
	// decided: their other points' observations can be on their way.
	Pending int
	Packets map[string]uint64 // per capture point
	Drops   map[string]uint64 // losses outside the engine (its own are in Summary)
}

// Result is everything a session learned.
type Result struct {
	// Node is the node as discovered, with the Pods that started during
	// the session (their capture points and tc programs too); a run until
	// stopped drops the Pods that went (PodsStarted counts them).
	Node *discover.NodeInfo
	// Attachments are the observers and taps, with those attached while
	// the session ran (Pods that started, veths that got a tc program):
	// of these, a run until stopped keeps the last 1024.
	Attachments []probe.Attachment
	Flows       []flow.Flow
	Summary     flow.Summary
	Drops       map[string]uint64 // losses outside the engine (its own are in Summary)
	Packets     map[string]uint64
	// StopReason: "duration", "interrupted", "max-packets", "max-bytes" or
	// "pcap-error".
	StopReason string
	// Began is when the capture began (every observer and tap in place);
	// Stopped, when the run was asked to stop.
	Began, Stopped time.Time
	// Summarized: packets the tc and netfilter observers summarized (probe.Stats).
	Summarized uint64
	// Pcap is what was written to Options.Pcap.
	Pcap *export.Summary
	// CaptureEnded names the capture points whose capture ended before the
	// session (their interface went down or away), with when and why.
	CaptureEnded map[string]string
	// CaptureGaps names the capture points whose interface went down and
	// came back (or not) while the session ran: nothing crossed it, so
	// nothing was captured there, for the time said.
	CaptureGaps map[string]string
	// ObserversEnded says when and why the observers' event reader ended
	// before the session ("" when it did not).
	ObserversEnded string
	// PodsStarted names the Pods that started during the session and were
	// followed from then on (taps, observers, scope), and what failed.
	PodsStarted []string
	// ObserversAdded names the tcx observers attached while the session
	// ran, on host veths that got a tc program, and what failed.
	ObserversAdded []string
	// NATRulesReread says when the NAT rules and IPVS services were read
	// again during the session, and what changed ("" when they were not).
	NATRulesReread string
	// TCProgramsChanged says which tc programs of the host veths and
	// uplinks appeared and went during the session, where and when.
	TCProgramsChanged []string
	// CPUWait is how long pathtrace's threads waited for a CPU during the
	// capture; nil when the kernel does not say (no schedstat).
	CPUWait *CPUWait
}

// tap is one capture point with its role label ("pod:eth0", "uplink:bond0").
type tap struct {
	label, role, ifname, netns string
	ifindex                    int // of ifname in netns
	point                      obs.Point
	t                          *capture.Tap
	// ended says why its capture ended before the session did ("" while
	// it runs): its producer writes it, read once the producers ended;
	// released is the same when the session closed it (releaseGone).
	ended, released *string
	inode           uint64 // of netns
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
		sp := discover.ServicePort{Addr: s.Addr, Port: s.Port}
		if s.Proto != 0 {
			sp.Proto = s.Proto.String()
		}
		opt.Discover.ServicePorts = append(opt.Discover.ServicePorts, sp)
	}

	pr, err := probe.New()
	if err != nil {
		return nil, fmt.Errorf("load observers: %w", err)
	}
	defer pr.Close()
	opt.Discover.IsObserver = pr.IsObserver

	discovered := time.Now() // the NAT rules are read after it
	node, err := discover.Node(ctx, opt.Discover)
	if err != nil {
		return nil, err
	}
	if err := pcapHeaderFits(opt.Pcap, opt.PcapLimits, node, opt.Snaplen); err != nil {
		return nil, err
	}
	if n := pr.ForeignObservers(); n > 0 {
		node.Notes = append(node.Notes, fmt.Sprintf("another pathtrace runs on this node: %d of its observer programs were found, and left out of attribution", n))
	}

	// The socket observers learn from the node's and its Pods' sockets
	// only, from the first one on.
	scope := netnsScope(node)
	if err := pr.Scope(slices.Collect(maps.Keys(scope))...); err != nil {
		return nil, err
	}
	watch := initialWatch(opt.Services, node)
	if err := pr.WatchEndpoints(watch...); err != nil {
		return nil, fmt.Errorf("watch addresses: %w", err)
	}

	cgroup := opt.Discover.Cgroup
	if cgroup == "" {
		if cgroup, err = cgroup2.Root(); err != nil {
			return nil, err
		}
	}
	// Everything is loaded before anything is attached, and the taps open
	// right after the observers: the start-up window in which a flow meets
	// some points and not others stays short (and its flows are marked).
	// A stop that came meanwhile ends the start between these steps, each
	// of which can take seconds on a node of many Pods (loading, then
	// attaching a tcx observer per veth direction under RTNL, then opening
	// the rings): nothing traced yet, it says so, and what was attached is
	// taken down at once rather than after an empty run's report.
	preloadObservers(pr, node)
	tapProg, tapProgErr := pr.TapFilter(opt.Snaplen) // owned by pr
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	atts := attachObservers(pr, node, cgroup, opt.Services)
	atts = append(atts, probe.KernelFunctionProbes()...)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	taps, tapAtts := openTaps(node, 0, watch, opt.Snaplen, opt.RingBytes, opt.CaptureBehind, tapProg, tapProgErr)
	defer closeTaps(taps)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	atts = append(atts, tapAtts...)
	ready := time.Now()
	pr.ReleaseSpecs() // everything is loaded: their BTF would stay live for nothing
	lb := newLBWatch(pr)

	eng := flow.NewEngine(flow.Config{
		Services:    opt.Services,
		Points:      activePoints(atts),
		Attribution: attribution(node),
		MaxFlows:    opt.MaxFlows,
		FlowTimeout: opt.FlowTimeout,
		HostNetNS:   node.HostNetNS.Inode,
		Ready:       ready,
		// 0 when unread: the engine takes the kernel's defaults.
		UDPTimeout:       time.Duration(node.Netfilter.UDPTimeout) * time.Second,
		UDPStreamTimeout: time.Duration(node.Netfilter.UDPStreamTimeout) * time.Second,
	})

	root, err := cgroup2.Root()
	if err != nil {
		root = cgroup
	}
	tr := &tracer{opt: opt, pr: pr, taps: taps, eng: eng, watch: watch, cgroupRoot: root, scope: scope, clients: clientScope(opt.Discover, node), clientVIPPorts: clientVIPPortScope(opt.Discover, node), classes: newClassTable(), lb: lb,
		tc:  newTCWatch(node, pr.IsObserver, time.Now()),
		nat: newNATWatch(node, discovered), node: node,
		late: &tcLate{observed: tcObserved(node), tails: needTails(node)},
		free: newBatchPool(freeBatches), freeSmall: newBatchPool(freeBatches), freeObs: newBatchPool(freeObsBatches)}
	defer func() { closeTaps(tr.taps) }() // with those of Pods that started
	if opt.Finished != nil {
		// A run until stopped is bounded by what the node has at once, not
		// by what came over the run: it forgets the taps that ended and
		// the Pods that went.
		tr.gone, tr.late.bounded = &goneTaps{}, true
	}
	if w := discover.NewPodWatch(node, opt.Discover); w != nil {
		tr.pods = &podFollow{watch: w, node: node, next: time.Now().Add(podWatchEvery), prog: tapProg, progErr: tapProgErr,
			maxPods: cmp.Or(opt.Discover.MaxPods, discover.DefaultMaxPods), untilStopped: opt.Finished != nil}
		if opt.Finished != nil {
			w.GiveRoomBack()
		}
	}
	if opt.Pcap != "" {
		if tr.pcap, err = openPcap(opt.Pcap, opt.PcapLimits, taps, opt.Snaplen); err != nil {
			return nil, err
		}
		tr.pcap.endsFileOnly = opt.PcapBoundEndsFileOnly
	}
	if opt.Ready != nil {
		opt.Ready(node, atts)
	}
	res := &Result{Node: node, Attachments: atts, Began: ready}
	// Loading the observers parsed the kernel's BTF (megabytes, garbage now):
	// give that memory back before the capture, which must stay small.
	debug.FreeOSMemory()
	if opt.CaptureStart != nil {
		opt.CaptureStart()
	}
	res.StopReason = tr.run(ctx)
	res.Stopped = tr.stopped
	res.CPUWait = tr.cpuWait.result()
	// The capture is over: the observers and taps leave the node's paths
	// now, not once the report is built. Read no more, their rings would
	// fill with what comes after the run and count it as lost (thousands
	// of events in a busy second, conntrack losses that undo verdicts),
	// and the rings (megabytes each) are unmapped before the report,
	// which is when the process needs the most memory. Their counters
	// stay readable, the pcapng statistics included.
	// Both wait for the kernel: a tcx observer's detach for a grace period
	// under the RTNL lock, one after the other, a tap's close for one of
	// its own (synchronize_net), so they overlap.
	var closing sync.WaitGroup
	closing.Go(func() { closeTaps(tr.taps) })
	pr.Detach()
	closing.Wait()
	if tr.pcap != nil {
		res.Pcap = tr.pcap.close(tr.taps)
	}
	res.Attachments = append(res.Attachments, tr.late.atts...)
	discover.RefreshGatewayMACs(node)
	eng.SetGatewayMACs(gatewayMACs(node))
	// The next hops resolved during the run name the last flows' uplink MACs.
	_ = discover.RefreshUplinkNeighbors(node)
	eng.SetUplinkNeighbors(uplinkNeighbors(node))

	// The capture's working memory (frame batches, packet classes) is
	// garbage now: return it before the report adds its own.
	tr.classes, tr.free, tr.freeSmall, tr.freeObs = nil, nil, nil, nil
	debug.FreeOSMemory()
	if opt.CaptureDone != nil {
		opt.CaptureDone()
	}
	tr.noteConntrackLosses()
	tr.noteCaptureLosses()
	tr.noteLearnLosses()
	res.Flows = eng.Flows()
	tr.nameDrops(res.Flows)
	res.Summary = eng.Summary()
	res.Summary.OutOfScope = tr.outOfScope
	res.Packets, res.Drops = tr.counters()
	if g := tr.gone; g != nil {
		for _, e := range g.ended {
			if e.why != "" {
				if res.CaptureEnded == nil {
					res.CaptureEnded = map[string]string{}
				}
				res.CaptureEnded[e.label] = e.why
			}
		}
		if g.n > len(g.ended) {
			if res.CaptureEnded == nil {
				res.CaptureEnded = map[string]string{}
			}
			res.CaptureEnded[goneLabel] = fmt.Sprintf("%d capture points of Pods that went ended before the run (the last %d are listed); their frames are counted as %s's", g.n, len(g.ended), goneLabel)
		}
	}
	for _, tp := range tr.taps {
		if tp.t == nil {
			continue // forgotten: listed above
		}
		ended, gap := captureEnd(cmp.Or(*tp.released, *tp.ended), tp.t.Stats())
		if ended != "" {
			if res.CaptureEnded == nil {
				res.CaptureEnded = map[string]string{}
			}
			res.CaptureEnded[tp.label] = ended
		}
		if gap != "" {
			if res.CaptureGaps == nil {
				res.CaptureGaps = map[string]string{}
			}
			res.CaptureGaps[tp.label] = gap
		}
	}
	res.ObserversEnded = tr.obsEnded
	res.NATRulesReread = tr.nat.summary()
	res.TCProgramsChanged = tr.tc.summary()
	res.PodsStarted = tr.pods.summary()
	res.ObserversAdded = tr.late.summary()
	res.Summarized = pr.Stats().Summarized
	return res, nil
}

// initialWatch is the VIPs plus every backend the node's NAT rules and IPVS
// services name. A Service given with its port is watched on that endpoint
// (and protocol, when given) only: a NodePort is the node's own address,
// whose every other packet (the kubelet's, ssh) would otherwise pass the
// taps into the capture file and the observers into the event ring, as
// would a ClusterIP's other ports. Given without a port, every port.
func initialWatch(svcs []flow.Service, node *discover.NodeInfo) []obs.Watch {
	var out []obs.Watch
	vips := map[netip.Addr]bool{}
	anyPort := map[netip.Addr]bool{}
	for _, s := range svcs {
		if s.Port == 0 {
			anyPort[s.Addr] = true
		}
	}
	vipSeen := map[obs.Watch]bool{}
	for _, s := range svcs {
		vips[s.Addr] = true
		w := obs.Watch{Addr: s.Addr, Port: s.Port, Proto: s.Proto}
		if anyPort[s.Addr] {
			w = obs.WatchAddr(s.Addr)
		}
		if !vipSeen[w] { // a few VIPs
			vipSeen[w] = true
			out = append(out, w)
		}
	}
	seen := map[obs.Watch]bool{} // a Service may have thousands of endpoints
	add := func(w obs.Watch) {
		// A VIP watched on every port covers its own address as a
		// backend; one watched on its endpoint does not (a NodePort to a
		// hostNetwork backend on the node's address).
		if w.Addr.IsValid() && !anyPort[w.Addr] && !seen[w] && !vipSeen[w] {
			seen[w] = true
			out = append(out, w)
		}
	}
	for _, r := range node.Netfilter.Rules {
		if vips[r.Service] && !anyPort[r.Service] && !overlaps(svcs, r) {
			continue // another port of a VIP traced on some ports only
		}
		b := r.Backend
		w := obs.Watch{Addr: b.Addr(), Port: b.Port(), Proto: protoOf(r.Proto)}
		if w.Port == 0 {
			w.Port = r.Port // kept by the DNAT; 0: any
		}
		if r.PortRange || w.Port == 0 {
			w.Port, w.Proto = 0, 0
		}
		add(w)
	}
	for _, s := range node.IPVS.Services {
		for _, b := range s.Backends {
			w := obs.Watch{Addr: b.Addr(), Port: b.Port(), Proto: protoOf(s.Proto)}
			if w.Port == 0 {
				w.Proto = 0
			}
			add(w)
		}
	}
	return out
}

// overlaps tells whether a NAT rule of a traced VIP's address (its port
// 0: any) can serve one of the traced Services on that address.
func overlaps(svcs []flow.Service, r discover.NATRule) bool {
	for _, s := range svcs {
		if s.Addr == r.Service && (s.Port == 0 || r.Port == 0 || s.Port == r.Port) &&
			(s.Proto == 0 || r.Proto == "" || s.Proto == protoOf(r.Proto)) {
			return true
		}
	}
	return false
}

// captureEnd is what the report says of a capture point whose capture
// ended early for why ("" when it went on to the end): ended, with how long
// its interface was down before (a Pod deleted: its veth went down, then
// away); or, when its capture went on, the gap its interface's downs made.
// A point is never both: a gap is one the capture went on across.
func captureEnd(why string, st capture.Stats) (ended, gap string) {
	gap = linkGap(st)
	switch {
	case why == "":
		return "", gap
	case gap != "":
		return why + "; before that, its interface " + gap, ""
	}
	return why, ""
}

// linkGap says how long a capture point's interface was down, "" when it
// never went down.
func linkGap(st capture.Stats) string {
	if st.LinkDowns == 0 {
		return ""
	}
	times := "once"
	if st.LinkDowns > 1 {
		times = fmt.Sprintf("%d times", st.LinkDowns)
	}
	return fmt.Sprintf("went down %s (first at %s), %.1f s in all", times, st.FirstDown.Format("15:04:05.000"), st.LinkDown.Seconds())
}
