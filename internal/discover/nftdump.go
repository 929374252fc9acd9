package discover

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// A big node's chains and rules are listed as the kernel sends them, one
// socket buffer at a time, each decoded and reduced as it comes:
// google/nftables' ListChains and GetRules (and netlink.Conn.Receive under
// them) hold every message of a dump, then every chain or rule decoded.
// On a node of 5,000 kube-proxy Services in iptables-nft, its 20,000
// chains and the 5,000 rules of KUBE-SERVICES, all held at once at each
// read of the rules, took a run's peak RSS past 64 MiB while a rollout
// had them read again.

// dumpBufSize holds any part of a dump: the kernel fills at most 32 KiB
// per part (netlink_dump).
const dumpBufSize = 64 << 10

// NFTDump sends an nf_tables dump request (msgType, of family, with attrs)
// over conn and gives fn the payload of each message of the reply as it
// is read.
func NFTDump(conn *netlink.Conn, msgType uint16, family uint8, attrs []netlink.Attribute, fn func(data []byte) error) error {
	data, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return err
	}
	req, err := conn.Send(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msgType), Flags: netlink.Request | netlink.Dump},
		Data:   append([]byte{family, unix.NFNETLINK_V0, 0, 0}, data...), // struct nfgenmsg
	})
	if err != nil {
		return err
	}
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	recv := func(b []byte) (n int, err error) {
		var flags int
		if rerr := rc.Read(func(fd uintptr) bool {
			n, _, flags, _, err = unix.Recvmsg(int(fd), b, nil, 0)
			return err != unix.EAGAIN && err != unix.EINTR
		}); rerr != nil {
			return 0, rerr
		}
		if err == nil && flags&unix.MSG_TRUNC != 0 {
			err = errors.New("netlink message larger than the buffer")
		}
		return n, err
	}
	return readDump(recv, req.Header.Sequence, fn)
}

// readDump reads the parts of the reply to dump request seq with recv,
// giving fn the payload of each message, until the dump ends. Once fn
// fails, the rest is read and dropped: the next request on the socket
// reads its own reply.
func readDump(recv func([]byte) (int, error), seq uint32, fn func(data []byte) error) error {
	buf := make([]byte, dumpBufSize)
	var fnErr error
	for {
		n, err := recv(buf)
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			switch {
			case m.Header.Seq != seq:
				continue // the rest of an earlier request's reply
			case m.Header.Type == unix.NLMSG_DONE || m.Header.Type == unix.NLMSG_ERROR:
				if len(m.Data) >= 4 {
					if errno := -int32(binary.NativeEndian.Uint32(m.Data)); errno > 0 {
						return syscall.Errno(errno)
					}
				}
				return fnErr
			case fnErr == nil:
				fnErr = fn(m.Data)
			}
		}
	}
}

// ruleExprs decodes the expressions of a rule listing's message
// (NFT_MSG_NEWRULE: nfgenmsg, then its attributes) of a table of family,
// those nftRuleEval reads (exprOf), and the rule's userdata. The others
// (counters, logs, ...) are not decoded: nftRuleEval.step ignores them.
func ruleExprs(family nftables.TableFamily, b []byte) (exprs []expr.Any, userData []byte, err error) {
	_, exprs, userData, err = decodeRule(family, b, exprOf)
	return exprs, userData, err
}

// RuleMsg decodes a rule listing's message of a table of family as
// google/nftables' GetRules does: its handle and its expressions.
func RuleMsg(family nftables.TableFamily, b []byte) (handle uint64, exprs []expr.Any, err error) {
	handle, exprs, _, err = decodeRule(family, b, anyExpr)
	return handle, exprs, err
}

// decodeRule decodes a rule listing's message: its handle, the
// expressions of the kinds kind names, and its userdata.
func decodeRule(family nftables.TableFamily, b []byte, kind func(name string) expr.Any) (handle uint64, exprs []expr.Any, userData []byte, err error) {
	if len(b) < 4 {
		return 0, nil, nil, fmt.Errorf("nftables rule message of %d bytes", len(b))
	}
	ad, err := netlink.NewAttributeDecoder(b[4:])
	if err != nil {
		return 0, nil, nil, err
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_RULE_HANDLE:
			handle = ad.Uint64()
		case unix.NFTA_RULE_EXPRESSIONS:
			ad.Nested(func(list *netlink.AttributeDecoder) error {
				for list.Next() {
					list.Nested(func(ed *netlink.AttributeDecoder) error {
						e, err := decodeExpr(byte(family), ed, kind)
						if e != nil {
							exprs = append(exprs, e)
						}
						return err
					})
				}
				return nil
			})
		case unix.NFTA_RULE_USERDATA:
			userData = ad.Bytes()
		}
	}
	if err := ad.Err(); err != nil {
		return 0, nil, nil, fmt.Errorf("decode nftables rule: %w", err)
	}
	return handle, exprs, userData, nil
}

// decodeExpr decodes one expression (NFTA_EXPR_NAME, NFTA_EXPR_DATA) as
// google/nftables does, an immediate to the verdict register as the
// verdict it is; nil for a kind that kind does not name.
func decodeExpr(family byte, ad *netlink.AttributeDecoder, kind func(name string) expr.Any) (expr.Any, error) {
	var e expr.Any
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_EXPR_NAME:
			e = kind(ad.String())
		case unix.NFTA_EXPR_DATA:
			if e == nil {
				return nil, nil
			}
			data := ad.Bytes()
			if err := expr.Unmarshal(family, data, e); err != nil {
				return nil, err
			}
			if imm, ok := e.(*expr.Immediate); ok && imm.Register == unix.NFT_REG_VERDICT && len(imm.Data) == 0 {
				e = &expr.Verdict{}
				if err := expr.Unmarshal(family, data, e); err != nil {
					return nil, err
				}
			}
			return e, nil
		}
	}
	// notrack has no data.
	if _, ok := e.(*expr.Notrack); ok {
		return e, nil
	}
	return nil, nil
}

// exprOf is an empty expression of a kind nftRuleEval.step reads, by its
// name in the kernel; nil for the others.
func exprOf(name string) expr.Any {
	switch name {
	case "payload":
		return &expr.Payload{}
	case "meta":
		return &expr.Meta{}
	case "bitwise":
		return &expr.Bitwise{}
	case "immediate":
		return &expr.Immediate{}
	case "numgen":
		return &expr.Numgen{}
	case "hash":
		return &expr.Hash{}
	case "ct":
		return &expr.Ct{}
	case "fib":
		return &expr.Fib{}
	case "cmp":
		return &expr.Cmp{}
	case "lookup":
		return &expr.Lookup{}
	case "reject":
		return &expr.Reject{}
	case "nat":
		return &expr.NAT{}
	case "target":
		return &expr.Target{}
	case "match":
		return &expr.Match{}
	}
	return nil
}

// anyExpr is an empty expression of any kind google/nftables decodes (its
// expr.exprFromName, and notrack), by its name in the kernel.
func anyExpr(name string) expr.Any {
	if e := exprOf(name); e != nil {
		return e
	}
	switch name {
	case "range":
		return &expr.Range{}
	case "counter":
		return &expr.Counter{}
	case "objref":
		return &expr.Objref{}
	case "redir":
		return &expr.Redir{}
	case "limit":
		return &expr.Limit{}
	case "quota":
		return &expr.Quota{}
	case "dynset":
		return &expr.Dynset{}
	case "log":
		return &expr.Log{}
	case "exthdr":
		return &expr.Exthdr{}
	case "connlimit":
		return &expr.Connlimit{}
	case "queue":
		return &expr.Queue{}
	case "flow_offload":
		return &expr.FlowOffload{}
	case "masq":
		return &expr.Masq{}
	case "cthelper":
		return &expr.CtHelper{}
	case "synproxy":
		return &expr.SynProxy{}
	case "ctexpect":
		return &expr.CtExpect{}
	case "secmark":
		return &expr.SecMark{}
	case "cttimeout":
		return &expr.CtTimeout{}
	case "notrack":
		return &expr.Notrack{}
	}
	return nil
}

// chainMsg is what a chain listing's message (NFT_MSG_NEWCHAIN) says of a
// chain.
type chainMsg struct {
	family      nftables.TableFamily
	table, name string
	hooked      bool // a base chain
	hooknum     uint32
	priority    int
	typ         nftables.ChainType
	// devices: a device hook's (NFTA_HOOK_DEV, or NFTA_HOOK_DEVS).
	devices []string
}

// parseChainMsg decodes one NFT_MSG_NEWCHAIN message (nfgenmsg, then its
// attributes).
func parseChainMsg(b []byte) (c chainMsg, err error) {
	if len(b) < 4 {
		return c, fmt.Errorf("nftables chain message of %d bytes", len(b))
	}
	c.family = nftables.TableFamily(b[0])
	ad, err := netlink.NewAttributeDecoder(b[4:])
	if err != nil {
		return c, err
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_CHAIN_TABLE:
			c.table = ad.String()
		case unix.NFTA_CHAIN_NAME:
			c.name = ad.String()
		case unix.NFTA_CHAIN_TYPE:
			c.typ = nftables.ChainType(ad.String())
		case unix.NFTA_CHAIN_HOOK:
			c.hooked = true
			ad.Nested(func(hd *netlink.AttributeDecoder) error {
				for hd.Next() {
					switch hd.Type() {
					case unix.NFTA_HOOK_HOOKNUM:
						c.hooknum = hd.Uint32()
					case unix.NFTA_HOOK_PRIORITY:
						c.priority = int(int32(hd.Uint32()))
					case unix.NFTA_HOOK_DEV:
						c.devices = append(c.devices, hd.String())
					case nftaHookDevs:
						hd.Nested(func(dd *netlink.AttributeDecoder) error {
							for dd.Next() {
								if dd.Type() == nftaDeviceName {
									c.devices = append(c.devices, dd.String())
								}
							}
							return nil
						})
					}
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		return c, fmt.Errorf("decode nftables chain: %w", err)
	}
	return c, nil
}

// chain is c as google/nftables lists it, for natHook and filterHook.
func (c chainMsg) chain(t *nftables.Table) *nftables.Chain {
	ch := &nftables.Chain{Name: c.name, Table: t, Type: c.typ}
	if c.hooked {
		hook, prio := nftables.ChainHook(c.hooknum), nftables.ChainPriority(c.priority)
		ch.Hooknum, ch.Priority = &hook, &prio
	}
	return ch
}

// SetElems gives fn each element of a set element listing's message
// (NFT_MSG_NEWSETELEM: nfgenmsg, then its attributes) as google/nftables'
// GetSetElements decodes it, but only its key, data and interval end.
func SetElems(b []byte, fn func(nftables.SetElement) error) error {
	if len(b) < 4 {
		return fmt.Errorf("nftables set element message of %d bytes", len(b))
	}
	ad, err := netlink.NewAttributeDecoder(b[4:])
	if err != nil {
		return err
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		if ad.Type() != unix.NFTA_SET_ELEM_LIST_ELEMENTS {
			continue
		}
		ad.Nested(func(list *netlink.AttributeDecoder) error {
			for list.Next() {
				var e nftables.SetElement
				if list.Type() == unix.NFTA_LIST_ELEM {
					list.Nested(func(ed *netlink.AttributeDecoder) error {
						for ed.Next() {
							switch ed.Type() {
							case unix.NFTA_SET_ELEM_KEY:
								ed.Nested(func(d *netlink.AttributeDecoder) error { e.Key = elemData(d); return nil })
							case unix.NFTA_SET_ELEM_DATA:
								ed.Nested(func(d *netlink.AttributeDecoder) error { e.Val = elemData(d); return nil })
							case unix.NFTA_SET_ELEM_FLAGS:
								e.IntervalEnd = ed.Uint32()&unix.NFT_SET_ELEM_INTERVAL_END != 0
							}
						}
						return nil
					})
				}
				if err := fn(e); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := ad.Err(); err != nil {
		return fmt.Errorf("decode nftables set elements: %w", err)
	}
	return nil
}

// elemData is an element's key or data: a value, or a verdict's
// attributes (which ElementVerdict decodes).
func elemData(ad *netlink.AttributeDecoder) []byte {
	var b []byte
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_DATA_VALUE, unix.NFTA_DATA_VERDICT:
			b = ad.Bytes()
		}
	}
	return b
}
