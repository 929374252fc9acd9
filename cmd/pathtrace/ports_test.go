package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/gopacket/gopacket/pcapgo"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// otherPorts are ports of the lab backend that serve no traced Service.
var otherPorts = []uint16{9100, 9101, 9102, 9103}

// TestBackendOtherPortsNotCaptured: a backend known with the port it serves
// (netfilter: the DNAT rule's target; socket: the endpoint the socket LB
// chose, learned in the kernel) is followed on that port only. The Pod's
// traffic to the same backend address on other ports (a metrics scrape, a
// flood) is not captured at any point, while the traced flows keep their
// verdicts, points and pcapng frames. Nor is it when a netns of no Pod of
// the node, with the Pod's address (another node's Pod on this host, as two
// kind clusters' Pods share their CIDR), sent to the Services from the
// flood's ports before: the socket observers see every socket of the host,
// and learn clients from the node's and its Pods' only.
func TestBackendOtherPortsNotCaptured(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-ports")
	stranger := strangerNetNS(t, filepath.Base(l.PodNetNS())+"-x")
	const requests = 3
	for _, mode := range []lab.Mode{lab.ModeNetfilter, lab.ModeSocket} {
		t.Run(string(mode), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := l.Up(ctx, mode); err != nil {
				t.Fatalf("lab up: %v", err)
			}
			gwMAC, err := l.GatewayMAC()
			if err != nil {
				t.Fatal(err)
			}
			pcap := filepath.Join(t.TempDir(), string(mode)+".pcapng")
			r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp",
				"--svc", lab.UDPVIP.String()+"/udp", "--duration", "60s", "--pcap", pcap)
			r.waitNode(t)
			res, err := l.Client(ctx, lab.ClientOptions{Requests: requests})
			if err != nil {
				t.Fatalf("lab client: %v", err)
			}
			time.Sleep(1500 * time.Millisecond) // the session's widen has run
			srcPorts, err := belowEphemeralPorts(l.PodNetNS(), len(otherPorts))
			if err != nil {
				t.Fatal(err)
			}
			if err := toServicesFrom(stranger, srcPorts); err != nil {
				t.Fatal(err)
			}
			if err := otherPortTraffic(l.PodNetNS(), srcPorts); err != nil {
				t.Fatal(err)
			}
			time.Sleep(300 * time.Millisecond)
			_ = r.cmd.Process.Signal(syscall.SIGINT)
			flows, summary := r.rest(t)
			for _, pr := range []lab.ProtoResult{res.TCP, res.UDP} {
				if pr.OK != requests {
					t.Errorf("client %s: %d ok, %d failed; want all to succeed", pr.Target, pr.OK, pr.Failed)
				}
			}
			if summary == nil {
				t.Fatal("no summary line")
			}
			if len(flows) != 2*requests {
				t.Errorf("%d flows, want %d: %s", len(flows), 2*requests, dump(flows))
			}
			for _, f := range flows {
				checkFlow(t, mode, f, gwMAC.String())
			}
			checkPcap(t, pcap, summary)
			if n := framesOnPorts(t, pcap, otherPorts); n != 0 {
				t.Errorf("the pcapng has %d frames to or from the backend's other ports %v", n, otherPorts)
			}
		})
	}
}

// otherPortTraffic sends, from the Pod, TCP connection attempts and UDP
// datagrams to the lab backend's otherPorts, from srcPorts, one each. The
// taps follow a traced flow's client endpoint whatever its peer (a stray
// reply from another port of the backend): a flood from one of the lab
// client's ports would rightly be captured.
func otherPortTraffic(netns string, srcPorts []uint16) error {
	return nsutil.Do(netns, func() error {
		for i, p := range otherPorts {
			ap := netip.AddrPortFrom(lab.BackendIP, p)
			d := net.Dialer{Timeout: 300 * time.Millisecond, LocalAddr: &net.TCPAddr{Port: int(srcPorts[i])}}
			if c, err := d.Dial("tcp4", ap.String()); err == nil {
				c.Close()
			}
			c, err := net.DialUDP("udp4", &net.UDPAddr{Port: int(srcPorts[i])}, net.UDPAddrFromAddrPort(ap))
			if err != nil {
				return fmt.Errorf("udp to %v: %w", ap, err)
			}
			for range 20 {
				_, _ = c.Write([]byte("flood"))
			}
			c.Close()
		}
		return nil
	})
}

// belowEphemeralPorts returns n ports just below the netns's ephemeral
// ones, which the kernel gives no socket that did not ask for them (the lab
// client's).
func belowEphemeralPorts(netns string, n int) ([]uint16, error) {
	var low int
	err := nsutil.Do(netns, func() error {
		b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
		if err != nil {
			return err
		}
		_, err = fmt.Sscan(string(b), &low)
		return err
	})
	if err != nil || low <= n {
		return nil, fmt.Errorf("ephemeral ports of %s: from %d: %v", netns, low, err)
	}
	ports := make([]uint16, n)
	for i := range ports {
		ports[i] = uint16(low - 1 - i)
	}
	return ports, nil
}

// strangerNetNS makes a netns, name, that is no Pod of the lab's node and
// has the lab Pod's address, routed out of a veth of its own.
func strangerNetNS(t *testing.T, name string) string {
	t.Helper()
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	for _, args := range [][]string{
		{"netns", "add", name},
		{"-n", name, "link", "add", "s0", "type", "veth", "peer", "name", "s1"},
		{"-n", name, "link", "set", "s1", "up"},
		{"-n", name, "addr", "add", lab.PodIP.String() + "/22", "dev", "s0"},
		{"-n", name, "link", "set", "s0", "up"},
		{"-n", name, "route", "add", "default", "dev", "s0"},
	} {
		mustRun(t, nil, "ip", args...)
	}
	return "/run/netns/" + name
}

// toServicesFrom sends, from netns, a TCP connection attempt to the lab's
// TCP VIP and a datagram to its UDP VIP from each of srcPorts. Nothing
// answers: the socket observers see them leave.
func toServicesFrom(netns string, srcPorts []uint16) error {
	return nsutil.Do(netns, func() error {
		for _, p := range srcPorts {
			d := net.Dialer{Timeout: 50 * time.Millisecond, LocalAddr: &net.TCPAddr{Port: int(p)}}
			if c, err := d.Dial("tcp4", lab.TCPVIP.String()); err == nil {
				c.Close()
			}
			c, err := net.ListenUDP("udp4", &net.UDPAddr{Port: int(p)})
			if err != nil {
				return err
			}
			_, err = c.WriteToUDPAddrPort([]byte("query"), lab.UDPVIP)
			c.Close()
			if err != nil {
				return fmt.Errorf("udp to %v: %w", lab.UDPVIP, err)
			}
		}
		return nil
	})
}

// framesOnPorts counts the pcapng's TCP and UDP frames with one of ports on
// either side; not the ICMP errors about them, which the taps keep as every
// ICMP message of a watched address.
func framesOnPorts(t *testing.T, path string, ports []uint16) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		t.Fatal(err)
	}
	on := map[uint16]bool{}
	for _, p := range ports {
		on[p] = true
	}
	n := 0
	for {
		data, _, err := r.ReadPacketData()
		if err == io.EOF {
			return n
		}
		if err != nil {
			t.Fatalf("pcapng read: %v", err)
		}
		pkt := gopacket.NewPacket(data, layers.LayerTypeEthernet, gopacket.Default)
		if tcp, ok := pkt.Layer(layers.LayerTypeTCP).(*layers.TCP); ok && (on[uint16(tcp.SrcPort)] || on[uint16(tcp.DstPort)]) {
			n++
		} else if udp, ok := pkt.Layer(layers.LayerTypeUDP).(*layers.UDP); ok && (on[uint16(udp.SrcPort)] || on[uint16(udp.DstPort)]) {
			n++
		}
	}
}
