package discover

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// Files read from a thread inside the node netns: /proc/thread-self/net shows
// the thread's netns (/proc/net would show the process's), and /proc/sys/net
// is bound to the netns of the opener.
const (
	legacyTablesFile = "/proc/thread-self/net/ip_tables_names"
	ipvsFile         = "/proc/thread-self/net/ip_vs"
	bridgeNFSysctl   = "/proc/sys/net/bridge/bridge-nf-call-iptables"
	bridgeNFVLAN     = "/proc/sys/net/bridge/bridge-nf-filter-vlan-tagged"
	ipForwardSysctl  = "/proc/sys/net/ipv4/ip_forward"
	udpTimeoutSysctl = "/proc/sys/net/netfilter/nf_conntrack_udp_timeout"
	udpStreamSysctl  = "/proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream"
)

// readNetfilter reports the node netns's netfilter: DNAT rules reachable for
// the VIPs in nftables and iptables-legacy, and the sysctls deciding whether
// bridged and routed traffic meets them. It never creates a table.
func readNetfilter(ctx context.Context, hostPath string, svcs serviceSet, info *NodeInfo) Netfilter {
	var nf Netfilter
	nf.BridgeNFCallIPTables = readBoolSysctl(hostPath, bridgeNFSysctl)
	nf.BridgeNFFilterVLANTagged = readBoolSysctl(hostPath, bridgeNFVLAN)
	nf.IPForward = readBoolSysctl(hostPath, ipForwardSysctl)
	nf.UDPTimeout = readIntSysctl(hostPath, udpTimeoutSysctl)
	nf.UDPStreamTimeout = readIntSysctl(hostPath, udpStreamSysctl)

	var graphs []*natGraph
	var nftErr error
	if why := nftUnreadable(kmod.System); why != "" {
		nf.NFTables = why
	} else {
		var closeNFT func()
		graphs, nf.DeviceChains, closeNFT, nftErr = readNFT(hostPath, svcs)
		// The graphs read their chains as the matching below reaches them.
		defer closeNFT()
	}
	nftGraphs := len(graphs)
	legacy, status := readLegacyNAT(ctx, hostPath)
	nf.IPTablesLegacy = status
	graphs = append(graphs, legacy...)
	linkMarkers(graphs)
	for _, g := range graphs {
		for _, r := range g.matchServices(svcs) {
			if r.Verdict != "" {
				nf.Rejects = append(nf.Rejects, r)
			} else {
				nf.Rules = append(nf.Rules, r)
			}
		}
	}
	nf.BackendDrops = backendDrops(graphs, nf.Rules)
	for _, g := range graphs[nftGraphs:] {
		if g.err != nil {
			nf.IPTablesLegacy = "not fully read: " + g.err.Error()
		}
	}
	if nf.NFTables == "" {
		nat := 0
		for _, g := range graphs[:nftGraphs] {
			if g.hasNAT() {
				nat++
			}
			if g.err != nil && nftErr == nil {
				nftErr = g.err
			}
		}
		nf.NFTables = fmt.Sprintf("read %d table(s) with NAT chains", nat)
		if nftErr != nil {
			nf.NFTables = fmt.Sprintf("not fully read (%d table(s) read): %v", nftGraphs, nftErr)
		}
	}
	return nf
}

// linkMarkers gives each graph with filter chains the graphs of its source
// and family with NAT chains, whose marks its rules may match: kubelet's
// KUBE-FIREWALL drops what kube-proxy's KUBE-MARK-DROP marked at NAT.
func linkMarkers(graphs []*natGraph) {
	for _, f := range graphs {
		if !slices.ContainsFunc(f.bases, func(b natBase) bool { return !b.nat }) {
			continue
		}
		for _, g := range graphs {
			if g.source == f.source && g.family == f.family && g.hasNAT() {
				f.markers = append(f.markers, g)
			}
		}
	}
}

// backendDrops are the rules of graphs' filter chains after NAT that drop
// or reject packets to the backends the DNATs of rules name: a path from a
// base chain that names a backend's address, as a VIP's rejects are read
// (a NetworkPolicy's chain per Pod, which kube-router jumps to on the Pod's
// address), Service holding the backend.
func backendDrops(graphs []*natGraph, rules []NATRule) []NATRule {
	var ports []ServicePort
	for _, r := range rules {
		if r.Backend.IsValid() {
			ports = append(ports, ServicePort{Addr: r.Backend.Addr(), Port: r.Backend.Port(), Proto: r.Proto})
		}
	}
	if len(ports) == 0 {
		return nil
	}
	backends := newServiceSet(nil, ports)
	var out []NATRule
	for _, g := range graphs {
		// Only the filter chains after NAT: a walk of the NAT chains (a
		// verdict map of every Service) for each of a Service's thousands
		// of backends made discovery grow with Services times endpoints.
		after := slices.DeleteFunc(slices.Clone(g.bases), func(b natBase) bool { return !b.afterNAT() })
		for _, r := range g.matchFrom(after, backends.vips, backends.local) {
			if r.Verdict != "" && backends.allows(r.Service, r.Port, r.Proto) {
				out = append(out, r)
			}
		}
	}
	return out
}

// The sources of NAT rules (NATRule.Source).
const (
	SourceNFTables       = "nftables"
	SourceIPTablesLegacy = "iptables-legacy"
)

// bridgeNFAbsentNote says that br_netfilter is not loaded when a Pod's host
// veth is on a Linux bridge, which hands frames to netfilter only by it; ""
// otherwise: a routed Pod's packets (host veth on no bridge: Calico's,
// Cilium's) meet netfilter without it, and OVS never hands them there.
func bridgeNFAbsentNote(info *NodeInfo) string {
	if info.Netfilter.BridgeNFCallIPTables != nil {
		return ""
	}
	var bridges []string
	for _, p := range info.Pods {
		if p.HostPeer != nil && p.HostPeer.MasterKind == "bridge" && !slices.Contains(bridges, p.HostPeer.Master) {
			bridges = append(bridges, p.HostPeer.Master)
		}
	}
	if bridges == nil {
		return ""
	}
	return fmt.Sprintf("net.bridge.bridge-nf-call-iptables absent in the node netns (br_netfilter not loaded): bridged traffic skips iptables/nftables IP hooks (the Pods on %s)", strings.Join(bridges, ", "))
}

// NATWatch reads again, on demand, the node's NAT rules and IPVS services
// for the traced VIPs, as discovery read them: kube-proxy rewrites them
// whenever a Service or its endpoints change, also while a trace runs.
type NATWatch struct {
	hostPath string
	svcs     serviceSet
}

// NATWatch returns what reads again the NAT rules and IPVS services of n.
func (n *NodeInfo) NATWatch() *NATWatch {
	return &NATWatch{hostPath: n.HostNetNS.Path, svcs: n.svcs}
}

// Look reads the rules and services as they are now. unread names the
// sources ("nftables", "iptables-legacy", "ipvs") that could not be read in
// full this time: what they held before need not be gone.
func (w *NATWatch) Look(ctx context.Context) (nf Netfilter, ipvs IPVS, unread []string) {
	var scratch NodeInfo // its notes repeat discovery's
	nf = readNetfilter(ctx, w.hostPath, w.svcs, &scratch)
	ipvs = readIPVS(w.hostPath, w.svcs)
	for _, s := range []struct{ source, status string }{
		{SourceNFTables, nf.NFTables}, {SourceIPTablesLegacy, nf.IPTablesLegacy}, {"ipvs", ipvs.Note},
	} {
		if strings.HasPrefix(s.status, "not ") {
			unread = append(unread, s.source)
		}
	}
	return nf, ipvs, unread
}

// nftUnreadable tells why nftables is not listed on host h ("" when it is):
// listing opens a NETLINK_NETFILTER socket and asks the nf_tables subsystem,
// which makes the kernel load nfnetlink and nf_tables when they are not
// there, and pathtrace never changes the node. Without nf_tables there is
// no nftables ruleset to read anyway.
func nftUnreadable(h kmod.Host) string {
	if m := h.FirstToLoad(kmod.NFTables...); m != "" {
		if nl := h.NotLoaded(m); nl != m+" is not loaded" {
			return fmt.Sprintf("not read: %s (not listed: listing would load it)", nl)
		}
		return fmt.Sprintf("absent: %s not loaded (not listed: listing would load it)", m)
	}
	return ""
}

// readNFT reads the NAT graphs of the node netns's nftables tables and its
// chains on device hooks with their rewrites of the VIPs of svcs.
func readNFT(hostPath string, svcs serviceSet) (graphs []*natGraph, devChains []DeviceChain, closeConn func(), err error) {
	ns, err := netns.GetFromPath(hostPath)
	if err != nil {
		return nil, nil, func() {}, fmt.Errorf("open node netns: %w", err)
	}
	defer ns.Close()
	// One netlink socket for every request: without AsLasting each request
	// dials its own, entering the node netns and leaving it again.
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)), nftables.AsLasting())
	if err != nil {
		return nil, nil, func() {}, fmt.Errorf("nftables netlink: %w", err)
	}
	// The chains and rules are listed over a socket of our own, as they
	// come (NFTDump); google/nftables lists a chain without its devices.
	raw, err := netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: int(ns)})
	if err != nil {
		conn.CloseLasting()
		return nil, nil, func() {}, fmt.Errorf("nftables netlink: %w", err)
	}
	closeConn = func() { conn.CloseLasting(); raw.Close() }
	if graphs, err = nftGraphs(conn, raw); err != nil {
		return graphs, nil, closeConn, err
	}
	if devChains, err = listDeviceChains(raw); err != nil {
		return graphs, devChains, closeConn, err
	}
	return graphs, devChains, closeConn, deviceRewrites(conn, raw, devChains, svcs)
}

// readLegacyNAT reads the iptables-legacy nat table and the filter table
// (where kube-proxy, or anything else, rejects or drops a Service's
// connections), each only if it already exists: any read through the legacy
// interface (iptables-legacy-save included) would create the table
// otherwise. The program that reads them is only run then.
func readLegacyNAT(ctx context.Context, hostPath string) ([]*natGraph, string) {
	var names []byte
	err := nsutil.Do(hostPath, func() error {
		var err error
		names, err = os.ReadFile(legacyTablesFile)
		return err
	})
	hasNAT, hasFilter := hasLine(names, "nat"), hasLine(names, "filter")
	switch {
	case os.IsNotExist(err):
		return nil, "absent: ip_tables module not loaded"
	case err != nil:
		return nil, "not checked: " + err.Error()
	case !hasNAT && !hasFilter:
		return nil, "absent: no legacy nat table (not read: reading would create it)"
	}
	bin, why := systemSaveTools(ctx, hostPath).legacySave()
	if bin == "" {
		return nil, "not checked: legacy tables exist but " + why
	}
	var graphs []*natGraph
	if hasNAT {
		g, err := legacyTable(ctx, hostPath, bin, "nat")
		if err != nil {
			return nil, "not checked: " + err.Error()
		}
		graphs = append(graphs, g)
	}
	if hasFilter {
		f, err := legacyTable(ctx, hostPath, bin, "filter")
		switch {
		case err != nil && hasNAT:
			return graphs, "nat read; filter not checked: " + err.Error()
		case err != nil:
			return nil, "not checked: " + err.Error()
		}
		graphs = append(graphs, f)
	}
	if !hasNAT {
		// What the filter table holds still reads: a reject or drop of
		// a Service's connections.
		return graphs, "filter read; no legacy nat table (not read: reading would create it)"
	}
	return graphs, "read"
}

// legacyTable dumps and parses one existing legacy table with bin, as the
// dump streams (megabytes on a node of thousands of Services).
func legacyTable(ctx context.Context, hostPath, bin, table string) (*natGraph, error) {
	var stderr bytes.Buffer
	var g *natGraph
	var parseErr error
	err := nsutil.Do(hostPath, func() error {
		// A child started from this locked thread inherits its netns.
		cmd := nsutil.Command(ctx, bin, "-t", table)
		cmd.Stderr = &stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return err
		}
		if err := cmd.Start(); err != nil {
			return err
		}
		g, parseErr = parseIPTablesSaveTable(out, SourceIPTablesLegacy, table)
		if parseErr != nil {
			io.Copy(io.Discard, out) // let it finish its output
		}
		return cmd.Wait()
	})
	if err != nil {
		return nil, fmt.Errorf("%s -t %s: %v %s", bin, table, err, strings.TrimSpace(stderr.String()))
	}
	return g, parseErr
}

// saveTools is how legacySave finds and asks programs (fakes in tests).
type saveTools struct {
	lookPath func(name string) (string, error)
	// version is the output (stdout and stderr) of `bin -t nat --version`;
	// an error when bin could not be run, or was not run.
	version func(bin string) (string, error)
}

// legacySave returns the program that dumps the iptables-legacy tables, or
// "" and why there is none: iptables-legacy-save, else an iptables-save
// that is not the nf_tables one. iptables before 1.8 (CentOS 7, Ubuntu
// 18.04) has only the legacy backend and only an iptables-save, without
// --version: it dumps the table given with -t instead (here nat, which
// exists: nothing is created), under a "# Generated by iptables-save
// v1.4.21" header. From 1.8 its version names the backend: "(legacy)" or
// "(nf_tables)".
func (t saveTools) legacySave() (bin, why string) {
	if bin, err := t.lookPath("iptables-legacy-save"); err == nil {
		return bin, ""
	}
	bin, err := t.lookPath("iptables-save")
	if err != nil {
		return "", "neither iptables-legacy-save nor iptables-save is installed"
	}
	out, err := t.version(bin)
	switch {
	case err != nil:
		return "", fmt.Sprintf("iptables-legacy-save is not installed and %s --version failed: %v", bin, err)
	case strings.Contains(out, "nf_tables"):
		return "", fmt.Sprintf("iptables-legacy-save is not installed and %s is the nf_tables one (%s)", bin, firstLine(out))
	}
	return bin, ""
}

// LegacySave is the program that dumps the iptables-legacy tables of the
// netns at hostPath (see legacySave), or "" and why there is none.
func LegacySave(ctx context.Context, hostPath string) (bin, why string) {
	return systemSaveTools(ctx, hostPath).legacySave()
}

// systemSaveTools finds programs in $PATH and runs them in the node netns.
func systemSaveTools(ctx context.Context, hostPath string) saveTools {
	return saveTools{lookPath: exec.LookPath, version: func(bin string) (string, error) {
		// A wrapper script (kube-proxy images' iptables-wrapper) may pick
		// a backend by rewriting the alternatives: only programs are run.
		if script, err := isScript(bin); err != nil || script {
			if err == nil {
				err = errors.New("a script, not run (it could change the node's iptables alternatives)")
			}
			return "", err
		}
		ctx, cancel := context.WithTimeout(ctx, versionTimeout)
		defer cancel()
		out := &headBuffer{max: 4096}
		err := nsutil.Do(hostPath, func() error {
			cmd := nsutil.Command(ctx, bin, "-t", "nat", "--version")
			cmd.Stdout, cmd.Stderr = out, out
			return cmd.Run()
		})
		var exit *exec.ExitError
		if errors.As(err, &exit) && exit.Exited() {
			err = nil // a version, an old iptables-save's complaint or dump: out tells
		}
		return out.String(), err
	}}
}

// versionTimeout bounds asking a program its version.
const versionTimeout = 5 * time.Second

// isScript tells whether the file at path (links followed) starts with "#!".
func isScript(path string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	head := make([]byte, 2)
	n, _ := io.ReadFull(f, head)
	return string(head[:n]) == "#!", nil
}

// headBuffer keeps the first max bytes written to it and discards the rest.
type headBuffer struct {
	bytes.Buffer
	max int
}

func (b *headBuffer) Write(p []byte) (int, error) {
	if room := b.max - b.Len(); room > 0 {
		b.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(strings.TrimSpace(s), "\n")
	return line
}

func hasLine(b []byte, want string) bool {
	for _, l := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(l) == want {
			return true
		}
	}
	return false
}

// readBoolSysctl reads a 0/1 sysctl of the node netns; nil when absent.
func readBoolSysctl(hostPath, file string) *bool {
	b, err := readSysctl(hostPath, file)
	if err != nil {
		return nil
	}
	v := strings.TrimSpace(string(b)) != "0"
	return &v
}

// readIntSysctl reads a number sysctl of the node netns; 0 when absent.
func readIntSysctl(hostPath, file string) int {
	b, err := readSysctl(hostPath, file)
	if err != nil {
		return 0
	}
	v, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return v
}

func readSysctl(hostPath, file string) ([]byte, error) {
	var b []byte
	err := nsutil.Do(hostPath, func() error {
		var err error
		b, err = os.ReadFile(file)
		return err
	})
	return b, err
}
