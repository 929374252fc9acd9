package discover

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"

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
	ipForwardSysctl  = "/proc/sys/net/ipv4/ip_forward"
)

// readNetfilter reports the node netns's netfilter: DNAT rules reachable for
// the VIPs in nftables and iptables-legacy, and the sysctls deciding whether
// bridged and routed traffic meets them. It never creates a table.
func readNetfilter(ctx context.Context, hostPath string, svcs serviceSet, info *NodeInfo) Netfilter {
	var nf Netfilter
	nf.BridgeNFCallIPTables = readBoolSysctl(hostPath, bridgeNFSysctl)
	if nf.BridgeNFCallIPTables == nil {
		info.notef("net.bridge.bridge-nf-call-iptables absent in the node netns (br_netfilter not loaded): bridged traffic skips iptables/nftables IP hooks")
	}
	nf.IPForward = readBoolSysctl(hostPath, ipForwardSysctl)

	var graphs []*natGraph
	if why := nftUnreadable(kmod.System); why != "" {
		nf.NFTables = why
	} else {
		var err error
		graphs, err = readNFT(hostPath)
		nf.NFTables = fmt.Sprintf("read %d table(s) with NAT chains", len(graphs))
		if err != nil {
			nf.NFTables = fmt.Sprintf("not fully read (%d table(s) read): %v", len(graphs), err)
		}
	}
	legacy, status := readLegacyNAT(ctx, hostPath)
	nf.IPTablesLegacy = status
	if legacy != nil {
		graphs = append(graphs, legacy)
	}
	for _, g := range graphs {
		nf.Rules = append(nf.Rules, g.matchServices(svcs)...)
	}
	return nf
}

// nftUnreadable tells why nftables is not listed on host h ("" when it is):
// listing opens a NETLINK_NETFILTER socket and asks the nf_tables subsystem,
// which makes the kernel load nfnetlink and nf_tables when they are not
// there, and pathtrace never changes the node. Without nf_tables there is
// no nftables ruleset to read anyway.
func nftUnreadable(h kmod.Host) string {
	if m := h.FirstToLoad("nfnetlink", "nf_tables"); m != "" {
		return fmt.Sprintf("absent: %s not loaded (not listed: listing would load it)", m)
	}
	return ""
}

func readNFT(hostPath string) ([]*natGraph, error) {
	ns, err := netns.GetFromPath(hostPath)
	if err != nil {
		return nil, fmt.Errorf("open node netns: %w", err)
	}
	defer ns.Close()
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return nil, fmt.Errorf("nftables netlink: %w", err)
	}
	return nftGraphs(conn)
}

// readLegacyNAT reads the iptables-legacy nat table, only if it already exists:
// any read through the legacy interface (iptables-legacy-save included) would
// create the table otherwise.
func readLegacyNAT(ctx context.Context, hostPath string) (*natGraph, string) {
	var names []byte
	err := nsutil.Do(hostPath, func() error {
		var err error
		names, err = os.ReadFile(legacyTablesFile)
		return err
	})
	switch {
	case os.IsNotExist(err):
		return nil, "absent: ip_tables module not loaded"
	case err != nil:
		return nil, "not checked: " + err.Error()
	case !hasLine(names, "nat"):
		return nil, "absent: no legacy nat table (not read: reading would create it)"
	}
	bin, err := exec.LookPath("iptables-legacy-save")
	if err != nil {
		return nil, "not checked: the legacy nat table exists but iptables-legacy-save is not installed"
	}
	var out, stderr bytes.Buffer
	err = nsutil.Do(hostPath, func() error {
		// A child started from this locked thread inherits its netns.
		cmd := exec.CommandContext(ctx, bin, "-t", "nat")
		cmd.Stdout, cmd.Stderr = &out, &stderr
		return cmd.Run()
	})
	if err != nil {
		return nil, fmt.Sprintf("not checked: %s -t nat: %v %s", bin, err, strings.TrimSpace(stderr.String()))
	}
	g, err := parseIPTablesSave(&out, "iptables-legacy")
	if err != nil {
		return nil, "not checked: " + err.Error()
	}
	return g, "read"
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
	var b []byte
	err := nsutil.Do(hostPath, func() error {
		var err error
		b, err = os.ReadFile(file)
		return err
	})
	if err != nil {
		return nil
	}
	v := strings.TrimSpace(string(b)) != "0"
	return &v
}
