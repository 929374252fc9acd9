package flow_test

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
)

const scenarioDir = "../../testdata/flows"

// TestScenarios runs every recorded sequence in its recorded (arrival) order,
// in reverse, and in random permutations: sources reorder events, and the
// verdicts must not depend on it.
func TestScenarios(t *testing.T) {
	scenarios, err := flowtest.LoadDir(scenarioDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(scenarios) < 20 {
		t.Fatalf("found %d scenarios in %s, want at least 20", len(scenarios), scenarioDir)
	}
	for _, s := range scenarios {
		t.Run(s.Name, func(t *testing.T) {
			for name, order := range orders(s) {
				e := s.Run(order)
				if errs := s.Want.Check(e.Flows(), e.Summary().Drops); len(errs) > 0 {
					t.Errorf("%s order:\n  %s", name, strings.Join(errs, "\n  "))
				}
			}
		})
	}
}

// orders returns the observation orders to try: recorded, reversed and shuffled.
func orders(s flowtest.Scenario) map[string][]int {
	out := map[string][]int{"recorded": nil}
	if s.Ordered {
		return out
	}
	n := len(s.Observations)
	rev := make([]int, n)
	for i := range rev {
		rev[i] = n - 1 - i
	}
	out["reversed"] = rev
	rng := rand.New(rand.NewPCG(1, uint64(n)))
	for _, name := range []string{"shuffled-1", "shuffled-2", "shuffled-3", "shuffled-4", "shuffled-5"} {
		out[name] = rng.Perm(n)
	}
	return out
}

// TestScenarioSummaries checks the per-place counts and that every flow is
// counted once.
func TestScenarioSummaries(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/mixed-modes.json")
	if err != nil {
		t.Fatal(err)
	}
	sum := s.Run(nil).Summary()
	want := map[flow.Place]int{flow.PlaceSocket: 1, flow.PlaceTC: 1, flow.PlaceNetfilter: 1,
		flow.PlaceIPVS: 0, flow.PlaceNowhere: 1, flow.PlaceUnknown: 1}
	if sum.Flows != 5 {
		t.Errorf("flows = %d, want 5", sum.Flows)
	}
	for p, n := range want {
		if got, ok := sum.RewrittenAt[p]; !ok || got != n {
			t.Errorf("rewritten_at[%s] = %d (present %v), want %d", p, got, ok, n)
		}
	}
	if sum.Observations["uplink"] == 0 || sum.Observations["pod"] == 0 {
		t.Errorf("observations per point missing: %v", sum.Observations)
	}
	for _, name := range []string{flow.DropFlowsOverMax, flow.DropUnmatchedOverflow} {
		if _, ok := sum.Drops[name]; !ok {
			t.Errorf("drop counter %s missing (must be reported even when zero)", name)
		}
	}
}

func TestFlowsSortedByFirstSeen(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/concurrent-netfilter.json")
	if err != nil {
		t.Fatal(err)
	}
	for name, order := range orders(s) {
		flows := s.Run(order).Flows()
		if !slices.IsSortedFunc(flows, func(a, b flow.Flow) int { return a.First.Compare(b.First) }) {
			t.Errorf("%s order: flows not sorted by first seen", name)
		}
		for _, f := range flows {
			if len(f.Points) == 0 || f.First.IsZero() || f.Last.Before(f.First) {
				t.Errorf("%s order: flow %d lacks points or times: %+v", name, f.ID, f)
			}
		}
	}
}

func TestBackendsLearned(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/tc-udp.json")
	if err != nil {
		t.Fatal(err)
	}
	e := flow.NewEngine(s.Config)
	if got := e.Backends(); len(got) != 0 {
		t.Fatalf("backends before any observation = %v, want none (tc mode has no NAT rules)", got)
	}
	for _, o := range s.Observations {
		e.Add(o)
	}
	got := e.Backends()
	if len(got) != 1 || got[0].String() != "10.244.20.31" {
		t.Errorf("backends = %v, want [10.244.20.31]", got)
	}
}

func TestBackendsFromNATRules(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/concurrent-netfilter.json")
	if err != nil {
		t.Fatal(err)
	}
	got := flow.NewEngine(s.Config).Backends()
	if len(got) != 2 || got[0].String() != "10.244.20.31" || got[1].String() != "10.244.20.32" {
		t.Errorf("backends from NAT rules = %v, want [10.244.20.31 10.244.20.32]", got)
	}
}
