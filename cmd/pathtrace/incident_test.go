package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestIncidentBundle runs `pathtrace incident` against the lab in netfilter
// mode: the bundle holds every part, a second incident is refused while one
// runs, and the node is the same before and after.
func TestIncidentBundle(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	before := nodeState(t, l)

	out := filepath.Join(t.TempDir(), "incident")
	cmd := pathtrace("incident", "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--svc", lab.UDPVIP.String(), "--duration", "5s", "--out", out)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	// The capture file appears once the lock is held and the taps are open.
	waitFor(t, filepath.Join(out, "capture.pcapng.partial"), cmd)

	second := pathtrace("incident", "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--duration", "1s", "--out", out+"-second")
	msg, err := second.CombinedOutput()
	if exitCode(err) != exitRuntime || !strings.Contains(string(msg), "another pathtrace incident is running") {
		t.Errorf("second incident: exit %d, %q; want it refused", exitCode(err), msg)
	}
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 2}); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pathtrace incident: %v\n%s", err, stderr.String())
	}

	for _, name := range []string{"SUMMARY.md", "report.txt", "report.json", "capture.pcapng", "MANIFEST.txt",
		"manifest.json", "net-node.txt", "net-pod-1.txt", "bridges.txt", "tc.txt", "cgroup-sock.txt",
		"nftables.txt", "iptables-legacy-nat.txt", "conntrack.txt", "sysctl.txt", "kernel.txt"} {
		if st, err := os.Stat(filepath.Join(out, name)); err != nil || st.Size() == 0 {
			t.Errorf("bundle part %s: %v", name, err)
		}
	}
	if _, err := os.Stat(out + ".tar.gz"); err != nil {
		t.Errorf("bundle archive: %v", err)
	}
	summary, _ := os.ReadFile(filepath.Join(out, "SUMMARY.md"))
	if !strings.Contains(string(summary), "netfilter") || !strings.Contains(string(summary), "10.244.20.31:3000") {
		t.Errorf("SUMMARY.md does not state the netfilter verdict:\n%s", summary)
	}
	nft, _ := os.ReadFile(filepath.Join(out, "nftables.txt"))
	if !strings.Contains(string(nft), "kube-proxy") {
		t.Errorf("nftables.txt lacks the kube-proxy table:\n%s", nft)
	}
	if after := nodeState(t, l); after != before {
		t.Errorf("the node changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// waitFor waits until path exists or cmd exits.
func waitFor(t *testing.T, path string, cmd interface{ String() string }) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return
		}
	}
	t.Fatalf("%s never appeared (%s)", path, cmd)
}

// nodeState renders what the lab node has that pathtrace must leave as it
// was: its nftables ruleset, tcx programs on its interfaces, qdiscs and tc
// filters, and the programs on the lab client's cgroup.
func nodeState(t *testing.T, l *lab.Lab) string {
	t.Helper()
	var b strings.Builder
	err := nsutil.Do(l.NodeNetNS(), func() error {
		h, err := netns.Get()
		if err != nil {
			return err
		}
		defer h.Close()
		conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
		if err != nil {
			return err
		}
		tables, err := conn.ListTables()
		if err != nil {
			return err
		}
		for _, tb := range tables {
			chains, _ := conn.ListChainsOfTableFamily(tb.Family)
			for _, c := range chains {
				if c.Table.Name != tb.Name {
					continue
				}
				rules, _ := conn.GetRules(tb, c)
				fmt.Fprintf(&b, "nft %s %s: %d rules\n", tb.Name, c.Name, len(rules))
			}
		}
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, lk := range links {
			for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				res, err := link.QueryPrograms(link.QueryOptions{Target: lk.Attrs().Index, Attach: at})
				if err == nil {
					fmt.Fprintf(&b, "tcx %s %v: %d programs\n", lk.Attrs().Name, at, len(res.Programs))
				}
			}
			qds, _ := netlink.QdiscList(lk)
			fmt.Fprintf(&b, "qdiscs %s: %d\n", lk.Attrs().Name, len(qds))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The lab client's cgroup, not the root: other test binaries attach
	// observers to the root while this test runs.
	f, err := os.Open(l.ClientCgroup())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, at := range []ebpf.AttachType{ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupInetEgress, ebpf.AttachCGroupInet6Connect} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at})
		if err == nil {
			fmt.Fprintf(&b, "cgroup %s %v: %d programs\n", l.ClientCgroup(), at, len(res.Programs))
		}
	}
	return b.String()
}
