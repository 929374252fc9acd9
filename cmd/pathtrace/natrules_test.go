package main

import (
	"io"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestServiceCreatedDuringTrace: a Service whose kube-proxy rule appears
// while pathtrace runs (a Service created, an endpoint replaced during an
// incident): its flows name that rule, read again once they reached a
// backend the rules read at the start did not name, and the summary says
// the rules were read again.
func TestServiceCreatedDuringTrace(t *testing.T) {
	needRoot(t)
	nft, err := exec.LookPath("nft")
	if err != nil {
		t.Skip("needs nft (apt-get install nftables) to add the Service's rule mid-trace")
	}
	l := upLab(t, lab.ModeNetfilter)
	const vip = "10.120.0.99:80"
	addRule := []string{"add", "rule", "ip", "kube-proxy", "services", "ip", "daddr", "10.120.0.99", "tcp", "dport", "80",
		"dnat", "to", lab.TCPBackend.String(), "comment", "pathtrace-test"}
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", vip+"/tcp", "--duration", "6s")
	node := r.waitNode(t)
	if rules, _ := node["netfilter"].(map[string]any)["rules"].([]any); len(rules) != 0 {
		t.Fatalf("the node has rules for %s before the test made one: %v", vip, rules)
	}
	t.Cleanup(func() { deleteRule(t, nft, l.NodeNetNS(), "pathtrace-test") })
	if err := nsutil.Do(l.NodeNetNS(), func() error {
		out, err := exec.Command(nft, addRule...).CombinedOutput()
		if err != nil {
			t.Errorf("nft %s: %v: %s", strings.Join(addRule, " "), err, out)
		}
		return err
	}); err != nil {
		t.FailNow()
	}
	for range 2 {
		if err := nsutil.Do(l.PodNetNS(), func() error { return httpGet(vip) }); err != nil {
			t.Fatalf("GET http://%s from the Pod: %v", vip, err)
		}
	}
	flows, summary := r.rest(t)
	if len(flows) != 2 {
		t.Fatalf("%d flows, want 2: %v", len(flows), flows)
	}
	for _, f := range flows {
		by, _ := f["by"].(string)
		if f["rewritten_at"] != "netfilter" || f["backend"] != lab.TCPBackend.String() || !strings.Contains(by, "dnat to "+lab.TCPBackend.String()) ||
			strings.Contains(by, "no NAT rule") {
			t.Errorf("flow %v at %v to %v by %q; want netfilter to %s by the rule made during the trace", f["client"], f["rewritten_at"], f["backend"], by, lab.TCPBackend)
		}
	}
	if got, _ := summary["nat_rules_reread"].(string); !strings.Contains(got, "read again") {
		t.Errorf("summary nat_rules_reread %q, want it to say the rules were read again", got)
	}
}

// httpGet makes one HTTP/1.0 request to addr and reads the answer.
func httpGet(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\n\r\n"); err != nil {
		return err
	}
	_, err = io.ReadAll(c)
	return err
}

// deleteRule deletes the rules of the lab's kube-proxy services chain whose
// comment is comment.
func deleteRule(t *testing.T, nft, netns, comment string) {
	err := nsutil.Do(netns, func() error {
		out, err := exec.Command(nft, "-a", "list", "chain", "ip", "kube-proxy", "services").Output()
		if err != nil {
			return nil // the lab is gone already
		}
		for _, line := range strings.Split(string(out), "\n") {
			if i := strings.Index(line, "# handle "); i >= 0 && strings.Contains(line, `"`+comment+`"`) {
				if out, err := exec.Command(nft, "delete", "rule", "ip", "kube-proxy", "services", "handle", strings.TrimSpace(line[i+len("# handle "):])).CombinedOutput(); err != nil {
					t.Errorf("nft delete rule: %v: %s", err, out)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Errorf("delete the test's rule: %v", err)
	}
}
