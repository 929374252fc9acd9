package flow_test

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
)

// TestHairpinOfAPodStartedLaterOnARoutedVeth: a Pod that started during
// the run on a routed node (its host veth, ifindex 4, has no master) sends
// a hairpin that never comes back: its reason blames no bridge's hairpin
// mode, as the routed scenario's does for a Pod there from the start; a
// veth said bridged again gets the bridge's words back.
func TestHairpinOfAPodStartedLaterOnARoutedVeth(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "netfilter-hairpin-self-routed-dropped.json"))
	if err != nil {
		t.Fatal(err)
	}
	s.Config.Attribution.RoutedHostVeths = nil
	for _, c := range []struct {
		routed map[int]bool
		want   string
	}{
		{map[int]bool{4: true}, "no hairpin mode applies"},
		{map[int]bool{4: true, 7: true}, "no hairpin mode applies"},
		{map[int]bool{4: false}, "only when that port has hairpin mode on"},
	} {
		e := flow.NewEngine(s.Config)
		e.SetHostVethsRouted(map[int]bool{4: true})
		e.SetHostVethsRouted(c.routed)
		for _, o := range s.Observations {
			e.Add(o)
		}
		fs := e.Flows()
		if len(fs) != 1 || !strings.Contains(fs[0].Reason, c.want) {
			t.Errorf("host veths routed %v: want one flow whose reason says %q, got %d: %+v", c.routed, c.want, len(fs), fs)
		}
	}
}
