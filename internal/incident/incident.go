// Package incident writes incident bundles: a directory (and a .tar.gz of it)
// holding pathtrace's evidence for a ticket. Snapshot collects the node's side
// of the seed article's evidence chain read-only (links, routes, bridges and
// VLANs, tc/tcx and cgroup programs, netfilter rules, conntrack entries for
// the VIPs, sysctls); WriteSummary states the verdicts in plain words; Tar
// packs the directory within a byte bound; Lock keeps two incidents on one
// node from interleaving.
//
// Read-only means: nothing is attached, created, loaded or reset. Listing the
// legacy iptables nat table would create it, so it is read only when
// ip_tables_names already lists it; netfilter netlink requests that would
// autoload a kernel module are not made (see package kmod).
package incident

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// Defaults for the zero values of Options.
const (
	DefaultSnapshotBytes    = 16 << 20
	DefaultFileBytes        = 4 << 20
	DefaultCollectorTimeout = 10 * time.Second
)

// maxPodNetNS bounds how many pod netns get their own network-state file;
// an incident is about a few Pods, a node may have hundreds.
const maxPodNetNS = 16

// minFileBytes is the least budget worth starting a collector for.
const minFileBytes = 1024

// Options tune a Snapshot. The zero value uses the defaults.
type Options struct {
	// Features are the BPF features pathtrace found (as the probe reported
	// them: "tcx", "netfilter links", "kprobes absent", ...).
	Features []string
	// OwnPrograms lists pathtrace's own programs, marked as such in the
	// program listings (a snapshot taken during a capture sees them).
	OwnPrograms func() []ebpf.ProgramID
	// MaxBytes bounds all snapshot files together; MaxFileBytes one file.
	// A file cut at its cap ends with a marker line saying how much was left out.
	MaxBytes     int64
	MaxFileBytes int64
	// CollectorTimeout bounds each collector.
	CollectorTimeout time.Duration
}

func (o *Options) defaults() {
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultSnapshotBytes
	}
	if o.MaxFileBytes <= 0 {
		o.MaxFileBytes = DefaultFileBytes
	}
	if o.CollectorTimeout <= 0 {
		o.CollectorTimeout = DefaultCollectorTimeout
	}
}

// SplitBudget divides a bundle's --max-bytes: the snapshot gets a quarter, at
// most DefaultSnapshotBytes; the rest is for the pcapng, the report and the
// summary.
func SplitBudget(maxBytes int64) (snapshot, rest int64) {
	snapshot = min(maxBytes/4, DefaultSnapshotBytes)
	return snapshot, maxBytes - snapshot
}

// snapshot is one Snapshot call's state.
type snapshot struct {
	node     *discover.NodeInfo
	hostPath string
	vips     []netip.Addr
	opt      Options
	own      map[ebpf.ProgramID]bool
}

// topic is one file of the snapshot and the collector that fills it.
type topic struct {
	file    string
	holds   string
	collect func(ctx context.Context, w *topicWriter) error
}

// Snapshot collects the node's state read-only into one file per topic under
// dir (created mode 0700: the bundle may hold payload) and writes the
// manifest. A collector that fails or times out is a note in the manifest,
// never an error; errors are for a bundle that cannot be written at all.
func Snapshot(ctx context.Context, node *discover.NodeInfo, vips []netip.Addr, dir string, opt Options) (Manifest, error) {
	if node == nil {
		return Manifest{}, errors.New("incident snapshot: no node information")
	}
	opt.defaults()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Manifest{}, fmt.Errorf("incident snapshot: %w", err)
	}
	s := &snapshot{node: node, hostPath: node.HostNetNS.Path, vips: vips, opt: opt, own: map[ebpf.ProgramID]bool{}}
	if s.hostPath == "" {
		s.hostPath = nsutil.Self
	}
	if opt.OwnPrograms != nil {
		for _, id := range opt.OwnPrograms() {
			s.own[id] = true
		}
	}

	m, err := s.collect(ctx, dir, s.topics())
	if err != nil {
		return m, err
	}
	if n := len(node.Pods) - maxPodNetNS; n > 0 {
		m.Notef("network state of %d more pod netns not collected (at most %d)", n, maxPodNetNS)
	}
	if err := m.Write(dir); err != nil {
		return m, err
	}
	return m, nil
}

// topicReserve bounds what each topic is kept of the snapshot's budget
// while the topics before it are collected.
const topicReserve = 64 << 10

// collect runs the topics' collectors in order and writes their files into
// dir, within the byte budget: each topic may take what the ones before it
// left, less a reserve for each topic after it (a share of the budget, at
// most topicReserve), so that one bulky file — the ruleset of a node with
// thousands of Services, megabytes — cannot starve the small, telling ones
// after it (the VIPs' conntrack entries, the node's routes and bridges). A
// topic that needs less than its reserve leaves the rest to the later ones.
func (s *snapshot) collect(ctx context.Context, dir string, topics []topic) (Manifest, error) {
	var m Manifest
	budget := s.opt.MaxBytes
	reserve := min(s.opt.MaxBytes/int64(2*max(len(topics), 1)), topicReserve)
	for i, t := range topics {
		if ctx.Err() != nil {
			m.Notef("%s: not collected: %v", t.file, context.Cause(ctx)) // why it was cancelled
			continue
		}
		limit := min(s.opt.MaxFileBytes, budget-reserve*int64(len(topics)-1-i))
		if limit < minFileBytes {
			m.Notef("%s: not collected: the snapshot's byte budget (%d bytes) is used up", t.file, s.opt.MaxBytes)
			continue
		}
		body, notes, truncated := s.run(ctx, t, int(limit))
		for _, n := range notes {
			m.Notef("%s: %s", t.file, n)
		}
		if err := os.WriteFile(filepath.Join(dir, t.file), body, 0o600); err != nil {
			return m, fmt.Errorf("incident snapshot: %w", err)
		}
		budget -= int64(len(body))
		m.Files = append(m.Files, File{Name: t.file, Bytes: int64(len(body)), Holds: t.holds, Truncated: truncated})
	}
	return m, nil
}

// run runs one collector under its timeout. A collector that overruns is
// abandoned (its blocking call returns on its own; its buffer is dropped).
func (s *snapshot) run(parent context.Context, t topic, limit int) (body []byte, notes []string, truncated bool) {
	ctx, cancel := context.WithTimeout(parent, s.opt.CollectorTimeout)
	defer cancel()
	w := newTopicWriter(limit)
	done := make(chan error, 1)
	go func() { done <- t.collect(ctx, w) }()
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		select {
		case err = <-done: // it ended as its time ran out: what it wrote stands
		default:
			msg := fmt.Sprintf("not collected: %v after %s", ctx.Err(), s.opt.CollectorTimeout)
			if parent.Err() != nil {
				// Interrupted (a second Ctrl-C), not out of its time: said as
				// for the topics after it (collect).
				msg = fmt.Sprintf("not collected: %v", context.Cause(parent))
			}
			return []byte("# " + msg + "\n"), []string{msg}, false
		}
	}
	if err != nil {
		fmt.Fprintf(w, "\n# not complete: %v\n", err)
		w.notef("not complete: %v", err)
	}
	body, truncated = w.finish()
	if truncated {
		w.notef("cut at %d bytes", limit)
	}
	return body, w.notes, truncated
}

// topics lists the snapshot's files, most telling first: when the byte
// budget runs out, what is left out is the bulk.
func (s *snapshot) topics() []topic {
	ts := []topic{
		{"kernel.txt", "kernel release, BPF features pathtrace found, what the node discovery noted", s.kernel},
		{"sysctl.txt", "bridge-nf-call-iptables, ip_forward, rp_filter of the node and capture interfaces, proxy_arp of the node's", s.sysctls},
		{"cgroup-sock.txt", "cgroup sock_addr programs (connect4, sendmsg4, ...) on the cgroup2 tree", s.cgroupPrograms},
		{"tc.txt", "qdiscs, tc filters, tcx and XDP programs on every capture interface", s.tcPrograms},
		{"nftables.txt", "the nftables ruleset of the node netns", s.nftables},
		{"iptables-nft.txt", "iptables-nft's nat and filter tables of the node netns as iptables-nft-save prints them (comments, DNAT targets), those that exist", s.iptablesNFT},
		{"iptables-legacy-nat.txt", "the iptables-legacy nat and filter tables of the node netns, those that exist", s.iptablesLegacy},
		{"conntrack.txt", "conntrack entries of the node netns whose original destination is a VIP", s.conntrack},
		{"bridges.txt", "bridges of the node netns: ports, VLANs, forwarding database", s.bridges},
		{"ovs.txt", "Open vSwitch bridges, ports and their VLAN tags, flows", s.ovs},
		{"net-node.txt", "links, addresses, routes, rules and neighbours of the node netns", s.netState(s.hostPath)},
	}
	for i, p := range s.node.Pods {
		if i == maxPodNetNS {
			break
		}
		ts = append(ts, topic{fmt.Sprintf("net-pod-%d.txt", i+1),
			fmt.Sprintf("links, addresses, routes, rules and neighbours of pod netns %s", podLabel(p)),
			s.podNetState(p)})
	}
	return append(ts, topic{"bpf-links.txt", "every BPF link on the machine (all netns) and its program", s.bpfLinks})
}

func podLabel(p discover.Pod) string {
	switch {
	case p.NSName != "":
		return p.NSName
	case p.PID != 0:
		return fmt.Sprintf("%s (pid %d %s)", p.NetNS.Path, p.PID, p.Comm)
	}
	return p.NetNS.Path
}
