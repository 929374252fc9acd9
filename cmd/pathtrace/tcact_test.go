package main

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestActNatOnHostVeth traces a Service whose VIP no BPF rewrites: u32
// filters on a routed Pod's host veth with act_nat (tc-nat(8), stateless),
// whose ingress sets the backend as the Pod's requests' destination and
// whose egress sets the VIP back as the replies' source (act_nat keeps the
// port). The flows are tc, by the ingress filter, named as tc(8) says it.
// Skipped on a kernel without act_nat.
func TestActNatOnHostVeth(t *testing.T) {
	needRoot(t)
	const vip, backend = "10.79.0.20:80", "10.78.0.9:80"
	ns := testNetns(t, fmt.Sprintf("ptta-an%d", os.Getpid()%100000), "node", "pod", "gw")
	node, pod, gw := ns[0], ns[1], ns[2]
	routedTopology(t, node, pod, gw, "an", "10.77.2", "192.168.78", []string{backend}, true)
	mustRun(t, nil, "ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	tc := func(args ...string) {
		t.Helper()
		out, err := exec.Command("tc", append([]string{"-n", node}, args...)...).CombinedOutput()
		if err != nil && strings.Contains(string(out), "Failed to load TC action module") {
			t.Skipf("this kernel has no act_nat (CONFIG_NET_ACT_NAT): tc %s: %s", strings.Join(args, " "), out)
		}
		if err != nil {
			t.Fatalf("tc %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	tc("qdisc", "add", "dev", "an-pod1", "clsact")
	tc("filter", "add", "dev", "an-pod1", "ingress", "pref", "10", "protocol", "ip", "u32", "match", "ip", "dst", "10.79.0.20/32",
		"action", "nat", "ingress", "10.79.0.20/32", "10.78.0.9")
	tc("filter", "add", "dev", "an-pod1", "egress", "pref", "10", "protocol", "ip", "u32", "match", "ip", "src", "10.78.0.9/32",
		"action", "nat", "egress", "10.78.0.9/32", "10.79.0.20")
	serveIn(t, "/run/netns/"+gw, backend)

	r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "30s")
	r.waitNode(t)
	const by = "u32 pref 10 on an-pod1 ingress: nat ingress 10.79.0.20/32 -> 10.78.0.9"
	for _, f := range r.flowsOf(t, "/run/netns/"+pod, vip, 2) {
		if f["rewritten_at"] != "tc" || f["by"] != by || f["backend"] != backend || f["reply"] != true {
			t.Errorf("want rewritten at tc to %s by %q, and a reply: %s", backend, by, dump([]map[string]any{f}))
		}
	}
}
