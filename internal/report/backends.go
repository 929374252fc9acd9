package report

import (
	"fmt"
	"io"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/pathtrace/pathtrace/internal/flow"
)

// maxBackendsListed bounds the backends the summary table lists (a run
// until stopped of a large Service meets many); the flows of the others
// are counted in one row.
const maxBackendsListed = 32

// backendCounts are the flows that reached each backend and how they were
// answered (the REPLY column's words): a Service of several backends one
// of which refuses or does not answer shows as that backend's row, not as
// a third of the rows to pick out by hand.
type backendCounts struct {
	by     map[netip.AddrPort]map[string]int
	others map[string]int // beyond maxBackendsListed
	// unseen: rewritten flows whose backend no point saw (a NodePort the
	// uplink's tc ingress redirected back out with BPF SNAT): their
	// answers count too, or a refusing backend among them goes unnoticed.
	unseen map[string]int
}

func (b *backendCounts) add(f flow.Flow) {
	if !f.Backend.IsValid() {
		if f.RewrittenAt != flow.PlaceNowhere && f.RewrittenAt != flow.PlaceUnknown && f.RewrittenAt != "" {
			if b.unseen == nil {
				b.unseen = map[string]int{}
			}
			b.unseen[reply(f)]++
		}
		return
	}
	if b.by == nil {
		b.by = map[netip.AddrPort]map[string]int{}
	}
	r := backendReply(f)
	if c, ok := b.by[f.Backend]; ok {
		c[r]++
		return
	}
	if len(b.by) >= maxBackendsListed {
		if b.others == nil {
			b.others = map[string]int{}
		}
		b.others[r]++
		return
	}
	b.by[f.Backend] = map[string]int{r: 1}
}

// replyLost is a backend's count of flows it answered whose replies the
// node lost on their way to the client (Flow.RepliesLostOnNode): REPLY no
// in the flow's row, but not the backend's failure.
const replyLost = "lost"

// replyUntranslated is a backend's count of flows it answered whose
// replies the node did not translate back to the VIP
// (Flow.UntranslatedReplies: a bridge with bridge-nf-call-iptables 0
// switched them straight to the client, which does not take them): REPLY
// no in the flow's row, but not the backend's failure either.
const replyUntranslated = "untranslated"

// notSent is a backend's count of flows none of whose requests left the
// node (Flow.NotSent: the kernel dropped at the uplink device, after its
// TX tap, every one the tap saw, or every one on the node after its
// rewrite): REPLY no in the flow's row, but no
// request reached the backend, so its silence is not its own.
const notSent = "unsent"

// backendReply is the word f is counted under for its backend: the REPLY
// column's, but "lost" for a flow whose backend answered and whose replies
// never reached the client's Pod, "untranslated" for one whose backend's
// replies reached it from the backend's address, and "unsent" for one whose
// requests never left the node, which "no" would each blame on the backend.
func backendReply(f flow.Flow) string {
	switch {
	case f.RepliesLostOnNode > 0:
		return replyLost
	case f.NotSent && reply(f) == "no":
		return notSent
	}
	r := reply(f)
	if r == "no" && f.UntranslatedReplies != nil {
		return replyUntranslated
	}
	return r
}

// replyOrder is the order of a backend's reply counts: answered first,
// then the failures an SRE acts on.
var replyOrder = []string{"yes", "rst", "icmp", replyLost, replyUntranslated, notSent, "no", "unseen"}

// replies formats counts as "yes 4, rst 3", and the total.
func replies(c map[string]int) (string, int) {
	var parts []string
	total := 0
	for _, r := range replyOrder {
		if n := c[r]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", r, n))
			total += n
		}
	}
	return strings.Join(parts, ", "), total
}

// write writes the flows per backend with their replies, when some flow
// reached one; the backends no flow got an answer from are marked, and
// those that answered only flows whose replies the node lost, or did not
// translate back, say so.
func (b backendCounts) write(w io.Writer) error {
	if len(b.by) == 0 && len(b.unseen) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	tw := newTable(w)
	fmt.Fprintln(tw, "BACKEND\tFLOWS\tREPLY")
	for _, be := range slices.SortedFunc(maps.Keys(b.by), netip.AddrPort.Compare) {
		c := b.by[be]
		r, n := replies(c)
		switch {
		case c["yes"] > 0 || c["unseen"] > 0 || n == 0:
		case c[replyLost] == n:
			// Only such flows (README): one that also refused or went
			// unanswered is not cleared of those by this mark.
			r += "  <- it answered; the node lost the replies on their way to the client"
		case c[replyUntranslated] == n:
			// Only such flows, as for "lost".
			r += "  <- it answered; the node did not translate its replies back"
		case c[notSent] == n:
			// No request reached it: nothing to blame it for.
			r += "  <- no request reached it: the node dropped them on their way out"
		case c[replyLost]+c[replyUntranslated]+c[notSent] == n:
			// Each flow failed on the node, not at the backend.
			r += "  <- not its failure: the node lost or did not translate its replies, or dropped the requests on their way out"
		default:
			r += "  <- no flow got a reply"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", be, n, r)
	}
	if len(b.others) > 0 {
		r, n := replies(b.others)
		fmt.Fprintf(tw, "(others)\t%d\t%s\n", n, r)
	}
	if len(b.unseen) > 0 {
		r, n := replies(b.unseen)
		fmt.Fprintf(tw, "(unseen)\t%d\t%s\n", n, r)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write backends table: %w", err)
	}
	return nil
}
