package main

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// nodeIface is a kernel drop's place at an interface of the node's netns
// that is no capture point, named: "the node's netns, br-pod (ifindex 5)".
var nodeIface = regexp.MustCompile(`^the node's netns, [^ ()]+ \(ifindex [0-9]+\)$`)

// TestKernelDropsTheReplies: a filter rule on the node drops the backend's
// replies at forward. pathtrace names the drops with each flow, in the
// reply direction, with the kernel's reason and the function that dropped
// them, and the flows read REPLY no; the flows before the rule have no
// drops and their replies.
func TestKernelDropsTheReplies(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp",
		"--svc", lab.UDPVIP.String()+"/udp", "--duration", "60s")
	node := r.waitNode(t)
	attached := false
	for _, o := range nodeObservers(node) {
		if o.name == "tp_btf/kfree_skb" {
			attached = o.attached
			if !o.attached {
				t.Fatalf("drop observer not attached: %s", o.err)
			}
		}
	}
	if !attached {
		t.Fatalf("no drop observer in the node's observers: %+v", nodeObservers(node))
	}
	before, err := l.Client(ctx, lab.ClientOptions{Requests: 1})
	if err != nil {
		t.Fatalf("lab client: %v", err)
	}
	if before.TCP.OK != 1 || before.UDP.OK != 1 {
		t.Fatalf("before the rule: %+v", before)
	}
	nodeNS := filepath.Base(l.NodeNetNS())
	rules := fmt.Sprintf(`table ip pt-drop {
	chain forward {
		type filter hook forward priority 0; policy accept;
		ip saddr %s drop
	}
}
`, lab.BackendIP)
	mustRun(t, strings.NewReader(rules), "ip", "netns", "exec", nodeNS, "nft", "-f", "-")
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "exec", nodeNS, "nft", "delete", "table", "ip", "pt-drop").Run()
	})
	after, err := l.Client(ctx, lab.ClientOptions{Requests: 2})
	if err != nil {
		t.Fatalf("lab client: %v", err)
	}
	if after.TCP.OK != 0 || after.UDP.OK != 0 {
		t.Fatalf("with the rule, requests succeeded: %+v", after)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, _ := r.rest(t)

	var answered, dropped int
	for _, f := range flows {
		desc := dump([]map[string]any{f})
		drops, _ := f["kernel_drops"].([]any)
		if f["reply"] == true {
			answered++
			if len(drops) > 0 {
				t.Errorf("a flow that got its replies has kernel_drops: %s", desc)
			}
			continue
		}
		dropped++
		if len(drops) == 0 {
			t.Errorf("a flow without reply has no kernel_drops: %s", desc)
			continue
		}
		// The replies dropped in the node's forward hook, each named as the
		// node's netns or a capture point of it, not by numbers alone. A
		// request may be dropped too, as a consequence: the client sends
		// its SYN again, and the backend's TCP frees the copy that finds
		// the connection it is already answering (tcp_v4_rcv,
		// NOT_SPECIFIED), as it does whenever a SYN-ACK is lost.
		forward := 0
		for _, d := range drops {
			m, _ := d.(map[string]any)
			if m["function"] == "" || m["count"].(float64) < 1 || m["netns"].(float64) == 0 {
				t.Errorf("kernel drop %v: want a function, a count and a netns: %s", m, desc)
			}
			w, _ := m["where"].(string)
			atNode := nodeIface.MatchString(w) || strings.HasPrefix(w, "uplink:") || strings.HasPrefix(w, "host:")
			switch {
			case m["direction"] == "reply" && m["reason"] == "NETFILTER_DROP" && atNode:
				forward++
			case m["direction"] == "request" && m["function"] == "tcp_v4_rcv" && f["proto"] == "tcp":
			default:
				t.Errorf("kernel drop %v: want a reply, NETFILTER_DROP, at an interface of the node's netns named, or one of its capture points (where %q): %s", m, w, desc)
			}
		}
		if forward == 0 {
			t.Errorf("no reply dropped by netfilter in the node among the flow's kernel drops: %s", desc)
		}
		if reason, _ := f["reason"].(string); !strings.Contains(reason, "reply packet") || !strings.Contains(reason, "NETFILTER_DROP") {
			t.Errorf("reason does not name the drops: %s", desc)
		}
	}
	if answered != 2 || dropped != 4 {
		t.Errorf("%d flows answered, %d without reply; want 2 and 4: %s", answered, dropped, dump(flows))
	}
}

// TestRequestDroppedByBackendRule: a filter rule at forward written on the
// backend's address (a NetworkPolicy's chain for the Pod) drops the
// requests kube-proxy rewrote to it. The node lists the rule among its
// backend drops, and the flow's reason says the kernel dropped the request
// on the node and names that rule.
func TestRequestDroppedByBackendRule(t *testing.T) {
	nft := needNFT(t)
	l := upLab(t, lab.ModeNetfilter)
	backend := lab.TCPBackend
	ruleset := fmt.Sprintf(`table ip pt-netpol {
	chain forward {
		type filter hook forward priority 0; policy accept;
		ip daddr %s jump pod-web
	}
	chain pod-web {
		tcp dport %d drop comment "deny web"
	}
}
`, backend.Addr(), backend.Port())
	if err := nftApply(nft, l.NodeNetNS(), ruleset); err != nil {
		t.Fatalf("nft -f: %v", err)
	}
	t.Cleanup(func() {
		nsutil.Do(l.NodeNetNS(), func() error { return exec.Command(nft, "delete", "table", "ip", "pt-netpol").Run() })
	})
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "4s")
	node := r.waitNode(t)
	drops, _ := node["netfilter"].(map[string]any)["backend_drops"].([]any)
	if !strings.Contains(fmt.Sprint(drops), "pod-web") || !strings.Contains(fmt.Sprint(drops), "deny web") {
		t.Errorf("node backend_drops %v, want pt-netpol's drop on pod-web", drops)
	}
	// The request is dropped: the GET times out, the flow is made all the same.
	nsutil.Do(l.PodNetNS(), func() error { return httpGet(lab.TCPVIP.String()) })
	flows, _ := r.rest(t)
	if len(flows) != 1 {
		t.Fatalf("%d flows, want 1: %s", len(flows), dump(flows))
	}
	// Every request was dropped after its rewrite: none reached the
	// backend, whose silence is not its own (not_sent).
	want := fmt.Sprintf(`the kernel dropped every one on the node, so none reached the backend; the node's filter drops or rejects packets to backend %s: nftables ip pt-netpol forward -> pod-web -> drop ("deny web")`, backend)
	if f := flows[0]; f["rewritten_at"] != "netfilter" || f["reply"] != false || f["not_sent"] != true || !strings.Contains(fmt.Sprint(f["reason"]), want) {
		t.Errorf("flow %s\nwant netfilter, no reply, not_sent, a reason containing %q", dump(flows), want)
	}
}
