package session

import (
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestHostRedirects: the engine gets the mirred redirects at the host
// veths' ingress, which take a Pod's packets past netfilter; a mirror (the
// packet itself goes on), an egress filter and an uplink's are left out.
func TestHostRedirects(t *testing.T) {
	node := &discover.NodeInfo{TCRedirects: []discover.TCRedirect{
		{Ifname: "veth-a", Ifindex: 5, Role: discover.RoleHost, Dir: "ingress", Filter: "u32 pref 10", Action: "egress redirect", To: "bond0"},
		{Ifname: "veth-a", Ifindex: 5, Role: discover.RoleHost, Dir: "ingress", Filter: "u32 pref 11", Action: "egress mirror", To: "mon0"},
		{Ifname: "veth-a", Ifindex: 5, Role: discover.RoleHost, Dir: "egress", Filter: "u32 pref 1", Action: "egress redirect", To: "bond0"},
		{Ifname: "bond0", Ifindex: 3, Role: discover.RoleUplink, Dir: "ingress", Filter: "matchall pref 1", Action: "egress redirect", To: "veth-a"},
	}}
	got := attribution(node).HostRedirects
	if len(got) != 1 || got[0].Ifindex != 5 || got[0].Text != "veth-a ingress u32 pref 10: mirred egress redirect to bond0" {
		t.Errorf("host redirects %+v, want the ingress redirect of veth-a alone", got)
	}
}
