package report

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// Progress is the one-line live status for stderr: elapsed/duration, flows,
// verdict counts, packets per capture point (the engine's observations per
// point when packets is nil) and total drops (the engine's and drops).
func Progress(elapsed, duration time.Duration, s flow.Summary, packets, drops map[string]uint64) string {
	var b strings.Builder
	b.WriteString(elapsed.Round(time.Second).String())
	if duration > 0 {
		b.WriteString("/" + duration.Round(time.Second).String())
	}
	fmt.Fprintf(&b, "  flows %d", s.Flows)
	var verdicts []string
	for _, p := range flow.Places() {
		if n := s.RewrittenAt[p]; n > 0 {
			verdicts = append(verdicts, fmt.Sprintf("%s %d", p, n))
		}
	}
	if len(verdicts) > 0 {
		fmt.Fprintf(&b, " (%s)", strings.Join(verdicts, ", "))
	}
	var points []string
	if packets != nil {
		names := make([]string, 0, len(packets))
		for name := range packets {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			points = append(points, fmt.Sprintf("%s %d", name, packets[name]))
		}
	} else {
		for p := obs.PointSockAddr; p <= obs.PointUplink; p++ {
			if n := s.Observations[p.String()]; n > 0 {
				points = append(points, fmt.Sprintf("%s %d", p, n))
			}
		}
	}
	if len(points) > 0 {
		fmt.Fprintf(&b, "  seen: %s", strings.Join(points, " "))
	}
	var lost uint64
	for _, n := range s.WithDrops(drops).Drops {
		lost += n
	}
	fmt.Fprintf(&b, "  drops %d", lost)
	return b.String()
}
