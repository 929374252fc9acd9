package discover

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"net/netip"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A tc filter that is not BPF (u32, flower, matchall) rewrites addresses by
// its actions: act_nat (tc-nat(8)), stateless, on older and hand-built
// nodes. vishvananda/netlink drops the actions it does not know, act_nat
// among them, so the filters are dumped again and their actions decoded
// here.

// Attributes of the kernel's uapi (pkt_cls.h, tc_act/tc_nat.h) that
// x/sys/unix lacks.
const (
	tcaU32Act      = 7 // TCA_U32_ACT
	tcaFlowerAct   = 3 // TCA_FLOWER_ACT
	tcaMatchallAct = 2 // TCA_MATCHALL_ACT
	tcaActKind     = 1 // TCA_ACT_KIND
	tcaActOptions  = 2 // TCA_ACT_OPTIONS
	tcaNatParms    = 1 // TCA_NAT_PARMS: struct tc_nat
	tcNatEgress    = 1 // TCA_NAT_FLAG_EGRESS: rewrite the source
	tcGenLen       = 20
	tcMsgLen       = 20 // struct tcmsg
)

// filterAction is one action of a tc filter that is not BPF.
type filterAction struct {
	kind, pref string // the filter's: "u32", "pref 10"
	action     string // the action's kind: "nat", "mirred", ...
	// rewrite says what a rewriting action does, as tc(8) says it
	// briefly ("nat ingress 10.120.0.80/32 -> 10.244.20.31"); "" for
	// the others.
	rewrite string
	dst     netip.Prefix // the destinations it rewrites; invalid: none
}

// filterActions decodes the actions of the filter of one RTM_NEWTFILTER
// message's data (struct tcmsg, then its attributes).
func filterActions(data []byte) ([]filterAction, error) {
	if len(data) < tcMsgLen {
		return nil, errors.New("short tcmsg")
	}
	prio := binary.NativeEndian.Uint32(data[16:20]) >> 16 // tcm_info: priority, protocol
	ad, err := netlink.NewAttributeDecoder(data[tcMsgLen:])
	if err != nil {
		return nil, err
	}
	var kind string
	var options []byte
	for ad.Next() {
		switch ad.Type() {
		case unix.TCA_KIND:
			kind = ad.String()
		case unix.TCA_OPTIONS:
			options = ad.Bytes()
		}
	}
	if err := ad.Err(); err != nil {
		return nil, err
	}
	actType := map[string]uint16{"u32": tcaU32Act, "flower": tcaFlowerAct, "matchall": tcaMatchallAct}[kind]
	if actType == 0 || options == nil {
		return nil, nil
	}
	if ad, err = netlink.NewAttributeDecoder(options); err != nil {
		return nil, err
	}
	var out []filterAction
	for ad.Next() {
		if ad.Type() != actType {
			continue
		}
		ad.Nested(func(tab *netlink.AttributeDecoder) error {
			for tab.Next() { // one per action, by its order
				a := filterAction{kind: kind, pref: fmt.Sprintf("pref %d", prio)}
				tab.Nested(func(act *netlink.AttributeDecoder) error {
					decodeAction(act, &a)
					return nil
				})
				out = append(out, a)
			}
			return nil
		})
	}
	return out, ad.Err()
}

// decodeAction fills a from the attributes of one action.
func decodeAction(ad *netlink.AttributeDecoder, a *filterAction) {
	var options []byte
	for ad.Next() {
		switch ad.Type() {
		case tcaActKind:
			a.action = ad.String()
		case tcaActOptions:
			options = ad.Bytes()
		}
	}
	if a.action != "nat" || options == nil {
		return
	}
	od, err := netlink.NewAttributeDecoder(options)
	if err != nil {
		return
	}
	for od.Next() {
		if p := od.Bytes(); od.Type() == tcaNatParms && len(p) >= tcGenLen+16 {
			// struct tc_nat: tc_gen, then old_addr, new_addr, mask (network
			// order) and flags.
			old := netip.AddrFrom4([4]byte(p[tcGenLen : tcGenLen+4]))
			to := netip.AddrFrom4([4]byte(p[tcGenLen+4 : tcGenLen+8]))
			from := netip.PrefixFrom(old, bits.OnesCount32(binary.BigEndian.Uint32(p[tcGenLen+8:tcGenLen+12]))).Masked()
			dir := "ingress"
			if binary.NativeEndian.Uint32(p[tcGenLen+12:tcGenLen+16])&tcNatEgress != 0 {
				dir = "egress" // the source: no destination rewritten
			} else {
				a.dst = from
			}
			a.rewrite = fmt.Sprintf("nat %s %s -> %s", dir, from, to)
		}
	}
}

// filterRewrites lists the rewriting actions of the filters that are not
// BPF on parent p of the interface ifindex of the netns nsFD, each as the
// program of a filter (it runs where a cls_bpf filter does), unnamed.
func filterRewrites(nsFD, ifindex int, p TCParent) ([]TCProgram, error) {
	c, err := netlink.Dial(unix.NETLINK_ROUTE, &netlink.Config{NetNS: nsFD})
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	defer c.Close()
	req := make([]byte, tcMsgLen) // struct tcmsg
	binary.NativeEndian.PutUint32(req[4:], uint32(ifindex))
	binary.NativeEndian.PutUint32(req[12:], p.Handle)
	msgs, err := c.Execute(netlink.Message{Header: netlink.Header{Type: unix.RTM_GETTFILTER, Flags: netlink.Request | netlink.Dump}, Data: req})
	if err != nil {
		return nil, fmt.Errorf("dump %s filters: %w", p.Dir, err)
	}
	var out []TCProgram
	for _, m := range msgs {
		actions, err := filterActions(m.Data)
		if err != nil {
			return out, fmt.Errorf("decode %s filters: %w", p.Dir, err)
		}
		for _, a := range actions {
			if a.rewrite != "" {
				out = append(out, TCProgram{Dir: p.Dir, Via: a.kind, Name: a.pref, Action: a.rewrite, Rewrites: a.dst})
			}
		}
	}
	return out, nil
}

// FilterRewrites is filterRewrites in the netns at path.
func FilterRewrites(path string, ifindex int, p TCParent) ([]TCProgram, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	return filterRewrites(int(ns), ifindex, p)
}
