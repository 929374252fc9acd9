package main

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestNetkitPod traces a Pod of Cilium's netkit datapath
// (bpf.datapathMode=netkit), in the pair's L3 mode (Cilium's default: no
// ARP, zero MACs, still an Ethernet header) and in L2 mode: the Pod's eth0
// is a netkit peer whose primary is in the node netns, routed (an address
// on the primary, no bridge), and the lab's tc LB is attached as the
// pair's programs (DNAT on what the Pod sends, the peer's list; reverse NAT
// on what the node sends to it, the primary's). The Pod is found behind its
// primary and captured on both ends, the node block lists the programs as
// netkit ones, and each flow is rewritten at tc by the peer's program,
// which runs inside the pair, between the Pod's eth0 tap and the primary's
// (no tcx observer there could bracket it). Needs a kernel with
// CONFIG_NETKIT.
func TestNetkitPod(t *testing.T) {
	needRoot(t)
	for _, mode := range []struct {
		name string
		mode netlink.NetkitMode
	}{{"l3", netlink.NETKIT_MODE_L3}, {"l2", netlink.NETKIT_MODE_L2}} {
		t.Run(mode.name, func(t *testing.T) {
			ns := testNetns(t, fmt.Sprintf("ptnk%d-%s", os.Getpid()%100000, mode.name), "node", "pod", "gw")
			node, pod, gw := ns[0], ns[1], ns[2]
			addNetkit(t, node, "nk-pod1", pod, mode.mode)
			backend := lab.TCPBackend
			ipAll(t, [][]string{
				{"link", "add", "nk-up", "netns", node, "type", "veth", "peer", "name", "nk-down", "netns", gw},
				{"-n", pod, "addr", "add", "10.77.6.5/24", "dev", "eth0"},
				{"-n", pod, "link", "set", "eth0", "up"},
				{"-n", pod, "route", "add", "default", "via", "10.77.6.1"},
				{"-n", node, "addr", "add", "10.77.6.1/24", "dev", "nk-pod1"},
				{"-n", node, "addr", "add", "192.168.76.2/24", "dev", "nk-up"},
				{"-n", node, "link", "set", "nk-pod1", "up"},
				{"-n", node, "link", "set", "nk-up", "up"},
				{"-n", node, "route", "add", "default", "via", "192.168.76.1"},
				{"-n", gw, "addr", "add", "192.168.76.1/24", "dev", "nk-down"},
				{"-n", gw, "addr", "add", backend.Addr().String() + "/32", "dev", "lo"},
				{"-n", gw, "link", "set", "nk-down", "up"},
				{"-n", gw, "link", "set", "lo", "up"},
				{"-n", gw, "route", "add", "10.77.6.0/24", "via", "192.168.76.2"},
			})
			mustRun(t, nil, "ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
			if err := lab.AttachNetkitLBTo("/run/netns/"+node, "nk-pod1"); err != nil {
				t.Fatal(err)
			}
			serveIn(t, "/run/netns/"+gw, backend.String())

			vip := lab.TCPVIP.String()
			r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "30s")
			nodeInfo := r.waitNode(t)
			var points []string
			cps, _ := nodeInfo["capture_points"].([]any)
			for _, c := range cps {
				cp, _ := c.(map[string]any)
				points = append(points, fmt.Sprint(cp["role"], ":", cp["ifname"]))
			}
			if got := strings.Join(points, " "); got != "pod:eth0 host:nk-pod1 uplink:nk-up" {
				t.Errorf("capture points %s, want the Pod's eth0, the pair's primary and the uplink", got)
			}
			var progs []string
			tcs, _ := nodeInfo["tc_programs"].([]any)
			for _, p := range tcs {
				m, _ := p.(map[string]any)
				progs = append(progs, fmt.Sprint(m["ifname"], " ", m["via"], " ", m["dir"], " ", m["name"]))
			}
			if got := strings.Join(progs, ", "); got != "nk-pod1 netkit ingress lab_from_container, nk-pod1 netkit egress lab_to_container" {
				t.Errorf("tc programs %s, want the pair's two programs, as netkit ones", got)
			}
			for _, f := range r.flowsOf(t, "/run/netns/"+pod, vip, 2) {
				by, _ := f["by"].(string)
				if f["rewritten_at"] != "tc" || !strings.Contains(by, "netkit peer lab_from_container") || f["backend"] != backend.String() || f["reply"] != true {
					t.Errorf("want rewritten at tc by the netkit peer program to %s, and a reply: %s", backend, dump([]map[string]any{f}))
				}
			}
		})
	}
}

// addNetkit adds in the netns node a netkit pair in mode: its primary
// primary there, its peer eth0 in the netns pod. The test is skipped on a
// kernel without netkit.
func addNetkit(t *testing.T, node, primary, pod string, mode netlink.NetkitMode) {
	t.Helper()
	podNS, err := netns.GetFromPath("/run/netns/" + pod)
	if err != nil {
		t.Fatal(err)
	}
	defer podNS.Close()
	err = nsutil.Netlink("/run/netns/"+node, func(h *netlink.Handle) error {
		nk := &netlink.Netkit{LinkAttrs: netlink.LinkAttrs{Name: primary}, Mode: mode}
		nk.SetPeerAttrs(&netlink.LinkAttrs{Name: "eth0", Namespace: netlink.NsFd(int(podNS))})
		return h.LinkAdd(nk)
	})
	if errors.Is(err, unix.EOPNOTSUPP) {
		t.Skipf("this kernel has no netkit devices (CONFIG_NETKIT): %v", err)
	}
	if err != nil {
		t.Fatalf("netkit pair: %v", err)
	}
}
