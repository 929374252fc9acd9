package report

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
)

// pathRoles orders the capture roles of the points' labels ("pod:eth0",
// "host:veth-a", "uplink:bond0") along a request's path.
var pathRoles = []string{"pod", "host", "uplink"}

// Progress is the one-line live status for stderr, cut to width columns: a
// longer line wraps, and the next \r rewrites only its last row. It says
// elapsed/duration, flows per verdict (pending of them: unknown yet, but
// what decides them may still come), total drops (the engine's and drops),
// and the frames captured per role, summed over the Pods' points so that
// the line does not grow with them. Parts that do not fit are left out
// from the end; flows drop their verdicts first.
func Progress(elapsed, duration time.Duration, s flow.Summary, pending int, packets, drops map[string]uint64, width int) string {
	clock := elapsed.Round(time.Second).String()
	if duration > 0 {
		clock += "/" + duration.Round(time.Second).String()
	}
	flows := fmt.Sprintf("flows %d", s.Flows)
	var verdicts []string
	for _, p := range flow.Places() {
		n := s.RewrittenAt[p]
		if p == flow.PlaceUnknown {
			n -= pending
		}
		if n > 0 {
			verdicts = append(verdicts, fmt.Sprintf("%s %d", p, n))
		}
	}
	if pending > 0 {
		verdicts = append(verdicts, fmt.Sprintf("pending %d", pending))
	}
	var lost uint64
	for _, n := range s.WithDrops(drops).Drops {
		lost += n
	}
	parts := [][]string{{clock}, {flows}, {fmt.Sprintf("drops %d", lost)}}
	if len(verdicts) > 0 {
		parts[1] = []string{flows + " (" + strings.Join(verdicts, ", ") + ")", flows}
	}
	if seen := perRole(packets); seen != "" {
		parts = append(parts, []string{"seen: " + seen})
	}
	return fitLine(parts, width)
}

// perRole sums the frames of the capture points by role, in path order.
func perRole(packets map[string]uint64) string {
	sums := map[string]uint64{}
	for label, n := range packets {
		role, _, _ := strings.Cut(label, ":")
		sums[role] += n
	}
	roles := slices.SortedFunc(maps.Keys(sums), func(a, b string) int {
		ia, ib := slices.Index(pathRoles, a), slices.Index(pathRoles, b)
		if ia < 0 {
			ia = len(pathRoles)
		}
		if ib < 0 {
			ib = len(pathRoles)
		}
		return cmp.Or(cmp.Compare(ia, ib), strings.Compare(a, b))
	})
	out := make([]string, len(roles))
	for i, r := range roles {
		out[i] = fmt.Sprintf("%s %d", r, sums[r])
	}
	return strings.Join(out, " ")
}

// fitLine joins parts with two spaces within width-1 columns (writing the
// last column makes some terminals wrap), each part in the first of its
// forms that fits, and stops at the first part none of whose forms fits;
// the first part is cut if need be. The parts are ASCII: a byte is a
// column.
func fitLine(parts [][]string, width int) string {
	room := max(width-1, 1)
	line := parts[0][0]
	if len(line) > room {
		return line[:room]
	}
	for _, forms := range parts[1:] {
		i := slices.IndexFunc(forms, func(f string) bool { return len(line)+2+len(f) <= room })
		if i < 0 {
			break
		}
		line += "  " + forms[i]
	}
	return line
}
