package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
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
// verdicts, points and pcapng frames.
func TestBackendOtherPortsNotCaptured(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-ports")
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
			if err := otherPortTraffic(l.PodNetNS()); err != nil {
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
// datagrams to the lab backend's otherPorts.
func otherPortTraffic(netns string) error {
	return nsutil.Do(netns, func() error {
		for _, p := range otherPorts {
			ap := netip.AddrPortFrom(lab.BackendIP, p)
			if c, err := net.DialTimeout("tcp", ap.String(), 300*time.Millisecond); err == nil {
				c.Close()
			}
			c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(ap))
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

// framesOnPorts counts the pcapng's TCP and UDP frames with one of ports on
// either side (ICMP errors quoting them included).
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
