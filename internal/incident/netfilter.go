package incident

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// nftables writes the node netns's nftables ruleset: `nft list ruleset` when
// nft is installed, else pathtrace's rendering of what netlink lists. nft
// takes seconds and hundreds of MB on a big cluster's node (14 s for 15,000
// kube-proxy Services): it gets two thirds of the collector's time, and
// when it overruns, the rest goes to a rendering from netlink narrowed to
// the traced Services (nftFocus), which reads only their chains.
func (s *snapshot) nftables(ctx context.Context, w *topicWriter) error {
	if m := kmod.FirstToLoad(kmod.NFTables...); m != "" {
		fmt.Fprintf(w, "%s: no nftables ruleset (not listed: listing would load the module)\n", kmod.NotLoaded(m))
		return nil
	}
	focus := newNFTFocus(s.node, s.vips)
	if nft, err := exec.LookPath("nft"); err == nil {
		fmt.Fprintf(w, "# %s list ruleset (in netns %s)\n", nft, s.hostPath)
		nftCtx, cancel := context.WithCancel(ctx)
		if deadline, ok := ctx.Deadline(); ok {
			nftCtx, cancel = context.WithDeadline(ctx, time.Now().Add(time.Until(deadline)*2/3))
		}
		err := s.listRuleset(nftCtx, w, newVIPLines(styleNFT, discover.SourceNFTables, s.node, s.vips, 0), nft, "list", "ruleset")
		overran := nftCtx.Err() != nil && ctx.Err() == nil
		cancel()
		switch {
		case err == nil:
			return nil
		case overran:
			fmt.Fprintf(w, "\n# nft did not finish in its share of the collector's time (a ruleset this large takes it longer)\n# falling back to pathtrace's rendering from netlink, narrowed to the traced Services\n")
			w.notef("nft list ruleset overran its time: rendered from netlink instead, narrowed to the traced Services")
			focus.always = true
		default:
			fmt.Fprintf(w, "\n# %v\n# falling back to pathtrace's rendering from netlink\n", err)
			w.notef("nft failed, rendered from netlink instead: %v", err)
		}
	} else {
		fmt.Fprintln(w, "# nft is not installed: rendered by pathtrace from netlink (github.com/google/nftables)")
	}
	conn, done, err := openNFTables(s.hostPath)
	if err != nil {
		return err
	}
	defer done()
	focus.room = max(w.limit-w.buf.Len(), 0)
	return renderRuleset(w, conn, focus, chainDevices(s.node))
}

// nftConn reads nftables in a netns: rules and set elements over a
// netlink socket of its own, each rendered as it comes (discover.NFTDump),
// the rest through google/nftables, whose GetRules and GetSetElements hold
// a whole chain or set at once (a chain of 50,000 rules took 170 MB, a
// blocklist of 200,000 addresses over 100 MiB).
type nftConn struct {
	*nftables.Conn
	raw *netlink.Conn
}

func (c nftConn) Rules(t *nftables.Table, ch *nftables.Chain, fn func(handle uint64, exprs []expr.Any) error) error {
	return discover.NFTDump(c.raw, unix.NFT_MSG_GETRULE, uint8(t.Family), []netlink.Attribute{
		{Type: unix.NFTA_RULE_TABLE, Data: []byte(t.Name + "\x00")},
		{Type: unix.NFTA_RULE_CHAIN, Data: []byte(ch.Name + "\x00")},
	}, func(b []byte) error {
		handle, exprs, err := discover.RuleMsg(t.Family, b)
		if err != nil {
			return err
		}
		return fn(handle, exprs)
	})
}

func (c nftConn) SetElements(set *nftables.Set, fn func(nftables.SetElement) error) error {
	return discover.NFTDump(c.raw, unix.NFT_MSG_GETSETELEM, uint8(set.Table.Family), []netlink.Attribute{
		{Type: unix.NFTA_SET_ELEM_LIST_TABLE, Data: []byte(set.Table.Name + "\x00")},
		{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: []byte(set.Name + "\x00")},
	}, func(b []byte) error { return discover.SetElems(b, fn) })
}

// openNFTables talks nftables netlink in the netns at path; done closes
// the netns, which the connection needs for each of its requests.
func openNFTables(path string) (conn nftConn, done func() error, err error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return conn, nil, fmt.Errorf("open node netns: %w", err)
	}
	if conn.Conn, err = nftables.New(nftables.WithNetNSFd(int(ns))); err != nil {
		ns.Close()
		return conn, nil, fmt.Errorf("nftables netlink: %w", err)
	}
	if conn.raw, err = netlink.Dial(unix.NETLINK_NETFILTER, &netlink.Config{NetNS: int(ns)}); err != nil {
		ns.Close()
		return conn, nil, fmt.Errorf("nftables netlink: %w", err)
	}
	return conn, func() error { conn.raw.Close(); return ns.Close() }, nil
}

// iptablesNFTFamilies are iptables-nft's address families: its tables are
// the nftables tables of the family named as xtables' (nat, filter).
var iptablesNFTFamilies = [...]struct {
	family nftables.TableFamily
	save   string
}{
	{nftables.TableFamilyIPv4, "iptables-nft-save"},
	{nftables.TableFamilyIPv6, "ip6tables-nft-save"},
}

// iptablesNFT writes the nat and filter tables iptables-nft keeps in
// nftables (kube-proxy's iptables mode on most nodes) as iptables-nft-save
// prints them: nft lists their xtables matches and targets without what
// they say (a -m comment blank, a REJECT without its --reject-with).
// Only tables that exist are read, and only with nft_compat there (what
// their xt expressions need): iptables-nft-save asks the kernel through it
// about the extensions it prints, which would load the module otherwise.
// Listing creates nothing.
func (s *snapshot) iptablesNFT(ctx context.Context, w *topicWriter) error {
	if m := kmod.FirstToLoad(slices.Concat(kmod.NFTables, []string{"nft_compat"})...); m != "" {
		fmt.Fprintf(w, "%s: no iptables-nft tables with xtables extensions (not listed: listing would load the module)\n", kmod.NotLoaded(m))
		return nil
	}
	conn, done, err := openNFTables(s.hostPath)
	if err != nil {
		return err
	}
	defer done()
	tables, err := conn.ListTables()
	if err != nil {
		return fmt.Errorf("list nftables tables: %w", err)
	}
	// The tables to list, first found: each listing gets a share of the
	// collector's time, so that one that overruns it (a nat table of
	// thousands of Services) is cut, what it wrote kept, not the whole
	// file abandoned with the topic (run).
	type listing struct{ bin, table, why string } // why: not listed
	var todo [][]listing
	for _, fam := range iptablesNFTFamilies {
		name := discover.NFTFamilyName(fam.family)
		var found []string
		for _, table := range []string{"nat", "filter"} {
			if slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Family == fam.family && t.Name == table }) {
				found = append(found, table)
			}
		}
		var ls []listing
		switch bin, err := exec.LookPath(fam.save); {
		case len(found) == 0:
			ls = []listing{{why: fmt.Sprintf("no nftables table %s nat or %s filter: no iptables-nft tables", name, name)}}
		case err != nil:
			ls = []listing{{why: fmt.Sprintf("nftables tables %s %s exist but %s is not installed: not read (nftables.txt lists them as nft does)", name, strings.Join(found, ", "), fam.save)}}
			w.notef("iptables-nft tables %s %s exist but %s is not installed", name, strings.Join(found, ", "), fam.save)
		default:
			for _, table := range found {
				ls = append(ls, listing{bin: bin, table: table})
			}
		}
		todo = append(todo, ls)
	}
	left := 0
	for _, ls := range todo {
		for _, l := range ls {
			if l.why == "" {
				left++
			}
		}
	}
	for i, ls := range todo {
		fmt.Fprintf(w, "## %s -t nat, -t filter\n", iptablesNFTFamilies[i].save)
		for _, l := range ls {
			if l.why != "" {
				fmt.Fprintln(w, l.why)
				continue
			}
			lctx, cancel := context.WithCancel(ctx)
			if deadline, ok := ctx.Deadline(); ok {
				lctx, cancel = context.WithDeadline(ctx, time.Now().Add(listingShare(time.Until(deadline), left)))
			}
			left--
			err := s.listRuleset(lctx, w, newVIPLines(styleIPTablesSave, discover.SourceNFTables, s.node, s.vips, 0), l.bin, "-t", l.table)
			overran := lctx.Err() != nil && ctx.Err() == nil
			cancel()
			switch {
			case overran:
				fmt.Fprintf(w, "\n# %s -t %s did not finish in its share of the collector's time: the listing above is cut there\n", l.bin, l.table)
				w.notef("%s -t %s overran its time: cut", l.bin, l.table)
			case err != nil:
				fmt.Fprintf(w, "not read: %v\n", err)
				w.notef("%v", err)
			}
		}
		fmt.Fprintln(w)
	}
	return nil
}

// listingShare is the time of one of n listings still to run when the
// collector has remaining: their equal parts of what is left once a
// reserve is kept to stop one that overruns and write what it got. The
// reserve is a tenth, and at least the command's kill and its
// commandWaitDelay with some room: a tenth of a short time (2 s) was less
// than a loaded machine takes to reap a killed listing, and the collector
// then overran too, its whole file lost for what the listing had written.
func listingShare(remaining time.Duration, n int) time.Duration {
	reserve := max(remaining/10, commandWaitDelay+500*time.Millisecond)
	return max(remaining-reserve, 0) / time.Duration(n)
}

// legacyFamily is one iptables-legacy address family.
type legacyFamily struct {
	namesFile string // lists the family's existing legacy tables
	save      string // its save command
	// find finds the save command, or says why there is none.
	find func(ctx context.Context, hostPath string) (bin, why string)
}

var legacyFamilies = [...]legacyFamily{
	// IPv4: also a legacy iptables-save of iptables before 1.8 (the same
	// choice as discovery's).
	{"ip_tables_names", "iptables-legacy-save", discover.LegacySave},
	{"ip6_tables_names", "ip6tables-legacy-save", func(context.Context, string) (string, string) {
		bin, err := exec.LookPath("ip6tables-legacy-save")
		if err != nil {
			return "", "ip6tables-legacy-save is not installed"
		}
		return bin, ""
	}},
}

// iptablesLegacy writes the legacy nat and filter tables that already
// exist (the filter table holds the rejects of Services without endpoints).
// Any read through the legacy interface (iptables-legacy-save included)
// creates the table it reads, so the list of existing tables is checked
// first.
func (s *snapshot) iptablesLegacy(ctx context.Context, w *topicWriter) error {
	for _, fam := range legacyFamilies {
		fmt.Fprintf(w, "## %s -t nat, -t filter\n", fam.save)
		tables, err := legacyTables(s.hostPath, fam.namesFile)
		switch {
		case errors.Is(err, os.ErrNotExist):
			fmt.Fprintf(w, "no legacy tables: %s is absent (module not loaded)\n\n", fam.namesFile)
			continue
		case err != nil:
			fmt.Fprintf(w, "not read: %v\n\n", err)
			w.notef("%s not read: %v", fam.namesFile, err)
			continue
		}
		fmt.Fprintf(w, "existing legacy tables: %s\n", orDash(strings.Join(tables, " ")))
		for _, table := range []string{"nat", "filter"} {
			if !containsString(tables, table) {
				fmt.Fprintf(w, "no legacy %s table (not read: reading would create it)\n", table)
				continue
			}
			bin, why := fam.find(ctx, s.hostPath)
			if bin == "" {
				fmt.Fprintf(w, "the legacy %s table exists but %s: not read\n", table, why)
				w.notef("legacy %s table exists but %s", table, why)
				continue
			}
			if err := s.listRuleset(ctx, w, newVIPLines(styleIPTablesSave, discover.SourceIPTablesLegacy, s.node, s.vips, 0), bin, "-t", table); err != nil {
				fmt.Fprintf(w, "not read: %v\n", err)
				w.notef("%v", err)
			}
		}
		fmt.Fprintln(w)
	}
	return nil
}

// legacyTables reads /proc/net/<file> of the netns at path: the thread's own
// view (/proc/thread-self/net), since /proc/net follows the process's netns.
func legacyTables(path, file string) ([]string, error) {
	var b []byte
	err := nsutil.Do(path, func() error {
		var err error
		b, err = os.ReadFile("/proc/thread-self/net/" + file)
		return err
	})
	return strings.Fields(string(b)), err
}

func containsString(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
