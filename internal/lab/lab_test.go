package lab

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
)

func needRoot(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: builds network namespaces, cgroups and BPF programs")
	}
}

// upTestLab brings up a lab with a unique name and tears it down at the end of
// the test, checking that nothing of it is left.
func upTestLab(t *testing.T, mode Mode) *Lab {
	t.Helper()
	needRoot(t)
	l := New(fmt.Sprintf("pttest-lab-%06x", rand.Uint32()&0xffffff))
	t.Cleanup(func() { downAndCheckGone(t, l) })
	if err := l.Up(context.Background(), mode); err != nil {
		t.Fatalf("Up(%s): %v", mode, err)
	}
	return l
}

// downAndCheckGone runs Down and checks that every namespace, the cgroup, the
// state, the worker processes and the lab's BPF programs are gone.
func downAndCheckGone(t *testing.T, l *Lab) {
	t.Helper()
	st, _ := l.Status()
	pids := l.workerPIDs()
	cgroup := l.ClientCgroup()
	if err := l.Down(); err != nil {
		t.Errorf("Down: %v", err)
	}
	for _, role := range roles() {
		if _, err := os.Stat(l.netnsPath(role)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("netns %s left after Down", l.netnsPath(role))
		}
	}
	for _, path := range []string{cgroup, l.stateDir()} {
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left after Down", path)
		}
	}
	for _, pid := range pids {
		if l.isOurWorker(pid, "") {
			t.Errorf("worker %d left after Down", pid)
		}
	}
	// Programs on devices go when the kernel has finished tearing the netns down.
	var left []AttachedProgram
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		left = stillLoaded(t, st.Programs)
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(left) > 0 {
		t.Errorf("lab programs still loaded after Down: %+v", left)
	}
}

// stillLoaded returns the programs of progs that the kernel still has, by ID and name.
func stillLoaded(t *testing.T, progs []AttachedProgram) []AttachedProgram {
	loaded := map[ebpf.ProgramID]string{}
	for id := ebpf.ProgramID(0); ; {
		next, err := ebpf.ProgramGetNextID(id)
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if err != nil {
			t.Fatalf("iterate programs: %v", err)
		}
		id = next
		if prog, err := ebpf.NewProgramFromID(id); err == nil {
			if info, err := prog.Info(); err == nil {
				loaded[id] = labProgramName(info.Name)
			}
			prog.Close()
		}
	}
	var left []AttachedProgram
	for _, p := range progs {
		if name, ok := loaded[p.ID]; ok && name == p.Name {
			left = append(left, p)
		}
	}
	return left
}

func runClient(t *testing.T, l *Lab, n int) ClientResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := l.Client(ctx, ClientOptions{Requests: n})
	if err != nil {
		t.Fatalf("Client: %v", err)
	}
	return res
}

// checkClient asserts that every request succeeded, or that every one failed
// fast: on an ICMP error, not on a timeout.
func checkClient(t *testing.T, mode Mode, res ClientResult, n int) {
	t.Helper()
	for _, p := range []ProtoResult{res.TCP, res.UDP} {
		if len(p.Requests) != n {
			t.Errorf("%s %s: %d requests, want %d", mode, p.Target, len(p.Requests), n)
		}
		for i, r := range p.Requests {
			switch {
			case mode != ModeNowhere && !r.OK:
				t.Errorf("%s %s request %d failed: %s: %s", mode, p.Target, i, r.Kind, r.Error)
			case mode == ModeNowhere && (r.OK || r.Kind != FailUnreachable):
				t.Errorf("%s %s request %d: ok=%v kind=%q (%s), want a fast ICMP unreachable failure",
					mode, p.Target, i, r.OK, r.Kind, r.Error)
			case r.OK && r.Peer != p.Target:
				t.Errorf("%s %s request %d: peer %s, want the VIP", mode, p.Target, i, r.Peer)
			}
		}
	}
}

// TestModes runs the client in each mode and checks what the uplink carried:
// every frame tagged VLAN 200 out of band, and the requests addressed to the
// backend when something translated them, to the VIP in nowhere mode.
func TestModes(t *testing.T) {
	needRoot(t)
	const requests = 5
	for _, mode := range Modes() {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			l := upTestLab(t, mode)
			uplink := openTap(t, l.NodeNetNS(), Uplink)

			checkClient(t, mode, runClient(t, l, requests), requests)

			gwMAC, err := l.GatewayMAC()
			if err != nil {
				t.Fatal(err)
			}
			wantDst := map[uint8]netip.AddrPort{6: TCPBackend, 17: UDPBackend}
			if mode == ModeNowhere {
				wantDst = map[uint8]netip.AddrPort{6: TCPVIP, 17: UDPVIP}
			}
			requestsSeen := map[uint8]int{}
			for _, f := range uplink.drain(t) {
				if !f.vlanValid || f.vlanTCI&0x0fff != VLAN {
					t.Errorf("frame on %s without out-of-band VLAN %d (valid=%v tci=%#x, ethertype %#04x)",
						Uplink, VLAN, f.vlanValid, f.vlanTCI, f.etherType())
				}
				ip, l4, ok := f.ipv4()
				if !ok || !f.outgoing || ipSrc(ip) != PodIP {
					continue
				}
				dst := netip.AddrPortFrom(ipDst(ip), l4Dst(l4))
				if dst != wantDst[ip[9]] {
					t.Errorf("request left %s to %s, want %s", Uplink, dst, wantDst[ip[9]])
				}
				if f.dstMAC().String() != gwMAC.String() {
					t.Errorf("request left %s to MAC %s, want the gateway's %s", Uplink, f.dstMAC(), gwMAC)
				}
				requestsSeen[ip[9]]++
			}
			if requestsSeen[6] < requests || requestsSeen[17] < requests {
				t.Errorf("requests seen on the uplink: %d tcp, %d udp; want at least %d each",
					requestsSeen[6], requestsSeen[17], requests)
			}
		})
	}
}

// TestSwitchModes switches one lab through every mode and checks that each
// switch leaves exactly the new mode's machinery, and that it works.
func TestSwitchModes(t *testing.T) {
	l := upTestLab(t, ModeSocket)
	vlanOnly := []string{labVLANProgLabVlanPop, labVLANProgLabVlanPop, labVLANProgLabVlanPush, labVLANProgLabVlanPush}
	wantProgs := map[Mode][]string{
		ModeSocket: append([]string{labLBProgLabSock4Connect, labLBProgLabSock4Getpeer,
			labLBProgLabSock4Recvmsg, labLBProgLabSock4Sendmsg}, vlanOnly...),
		ModeTC:        append([]string{labLBProgLabFromContainer, labLBProgLabToContainer}, vlanOnly...),
		ModeTCLegacy:  append([]string{labLBProgLabFromContainer, labLBProgLabToContainer}, vlanOnly...),
		ModeNetfilter: vlanOnly,
		ModeNowhere:   vlanOnly,
	}
	for _, mode := range []Mode{ModeTC, ModeTCLegacy, ModeNetfilter, ModeNowhere, ModeSocket, ModeTCLegacy, ModeTC, ModeTC} {
		if err := l.Up(context.Background(), mode); err != nil {
			t.Fatalf("Up(%s): %v", mode, err)
		}
		st, err := l.Status()
		if err != nil {
			t.Fatalf("Status in %s: %v", mode, err)
		}
		var names []string
		for _, p := range st.Programs {
			names = append(names, p.Name)
		}
		slices.Sort(names)
		want := slices.Sorted(slices.Values(wantProgs[mode]))
		if !slices.Equal(names, want) {
			t.Errorf("%s: lab programs %v, want %v", mode, names, want)
		}
		netfilter := mode == ModeNetfilter || mode == ModeNowhere
		if st.Mode != mode || st.KubeProxyRules != netfilter || (st.BridgeNFCallIPTables == "1") != (mode == ModeNetfilter) {
			t.Errorf("%s: status mode=%s kube-proxy rules=%v bridge-nf-call-iptables=%s",
				mode, st.Mode, st.KubeProxyRules, st.BridgeNFCallIPTables)
		}
		if !st.Healthy {
			t.Errorf("%s: unhealthy: %s", mode, st.Health)
		}
		if !netfilter {
			if n := conntrackEntries(t, l.NodeNetNS()); n != 0 {
				t.Errorf("%s: %d conntrack entries left in the node", mode, n)
			}
		}
		checkClient(t, mode, runClient(t, l, 2), 2)
	}
}

func conntrackEntries(t *testing.T, netnsPath string) int {
	t.Helper()
	ns, err := openNetNS(netnsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	c, err := conntrack.Dial(&netlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	flows, err := c.Dump(nil)
	if err != nil {
		t.Fatal(err)
	}
	return len(flows)
}

// TestTCChecksums checks the tc LB's checksum fix-ups on the wire, both for
// CHECKSUM_PARTIAL packets (veth default: the L4 field holds the pseudo-header
// sum, which must follow the rewritten address) and for packets with complete
// checksums (TX offload off).
func TestTCChecksums(t *testing.T) {
	l := upTestLab(t, ModeTC)
	for _, offload := range []bool{true, false} {
		if !offload {
			disableTXChecksum(t, l.PodNetNS(), PodIface)
			disableTXChecksum(t, l.BackendNetNS(), BackendIface)
		}
		toBackend := openTap(t, l.GatewayNetNS(), GatewayBackPort) // requests after DNAT
		toPod := openTap(t, l.PodNetNS(), PodIface)                // replies after reverse NAT
		checkClient(t, ModeTC, runClient(t, l, 2), 2)

		verified := map[string]int{}
		check := func(where string, frames []frame, translated func(ip, l4 []byte) bool) {
			for _, f := range frames {
				ip, l4, ok := f.ipv4()
				if !ok || !translated(ip, l4) {
					continue
				}
				if err := checkChecksums(f, ip, l4); err != nil {
					t.Errorf("offload=%v %s %s->%s: %v", offload, where,
						netip.AddrPortFrom(ipSrc(ip), l4Src(l4)), netip.AddrPortFrom(ipDst(ip), l4Dst(l4)), err)
				}
				if f.csumReady != offload {
					verified[fmt.Sprintf("%s/%d", where, ip[9])]++
				}
			}
		}
		check("request", toBackend.drain(t), func(ip, l4 []byte) bool {
			return ipSrc(ip) == PodIP && ipDst(ip) == BackendIP
		})
		check("reply", toPod.drain(t), func(ip, l4 []byte) bool {
			src := netip.AddrPortFrom(ipSrc(ip), l4Src(l4))
			return src == TCPVIP || src == UDPVIP
		})
		for _, key := range []string{"request/6", "request/17", "reply/6", "reply/17"} {
			if verified[key] == 0 {
				t.Errorf("offload=%v: no %s packet with %s checksum captured", offload, key,
					map[bool]string{true: "a partial", false: "a complete"}[offload])
			}
		}
	}
}

// TestUpRepairsHalfBuiltLab starts from leftovers of a crashed up: some
// namespaces, the cgroup, state naming a process that is not ours.
func TestUpRepairsHalfBuiltLab(t *testing.T) {
	needRoot(t)
	l := New(fmt.Sprintf("pttest-lab-%06x", rand.Uint32()&0xffffff))
	t.Cleanup(func() { downAndCheckGone(t, l) })
	for _, role := range []string{rolePod, roleGateway} {
		if err := createNetNS(l.netnsPath(role)); err != nil {
			t.Fatal(err)
		}
	}
	if err := createCgroup(l.ClientCgroup()); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(l.stateDir(), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(l.serverPIDFile(), []byte(fmt.Sprint(os.Getpid())), 0o644); err != nil {
		t.Fatal(err)
	}
	if st, _ := l.Status(); st.Complete {
		t.Fatal("a half-built lab reports complete")
	}
	if err := l.Up(context.Background(), ModeNetfilter); err != nil {
		t.Fatalf("Up over leftovers: %v", err)
	}
	if err := l.Up(context.Background(), ModeNetfilter); err != nil { // idempotent
		t.Fatalf("second Up: %v", err)
	}
	checkClient(t, ModeNetfilter, runClient(t, l, 2), 2)
	if err := l.Down(); err != nil {
		t.Fatal(err)
	}
	if err := l.Down(); err != nil { // nothing left to remove is fine
		t.Fatalf("second Down: %v", err)
	}
}
