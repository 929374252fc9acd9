/* The AF_PACKET taps' socket filter: it keeps the frames of watched flows
 * (a watched backend endpoint or an address watched on every port, or a
 * client endpoint the observers learned in the kernel), and the ICMP errors
 * about them, and drops the rest (a backend's other ports) before they are
 * copied to user space. It shares watch_addrs, watch_endpoints and
 * watch_clients with the
 * observers, so a tap follows a flow whose destination was rewritten from
 * the first packet after the rewrite, with no user-space round trip. It only
 * reads. */
#include "observe.h"

/* Bytes kept per accepted frame; set at load time. */
volatile const __u32 tap_snaplen = 96;

/* ICMP error messages: each quotes the packet it is about (RFC 792), that
 * packet's IP header and at least the first 8 bytes after it. */
#define PT_ICMP_DEST_UNREACH 3
#define PT_ICMP_TIME_EXCEEDED 11
#define PT_ICMP_PARAMETERPROB 12

/* The ICMP header and the quoted IP header (without its options), read at
 * once. */
struct pt_icmp_quote {
	struct icmphdr icmp;
	struct iphdr ip;
};

/* pt_load_icmp_quote reads the tuple of the packet an ICMP error message
 * quotes: the frame's IPv4 header (behind up to two in-band tags, with its
 * options) must carry an unfragmented ICMP destination unreachable, time
 * exceeded or parameter problem message, whose quoted IPv4 header (with its
 * options) is followed by the quoted L4 bytes; the ports are read from the
 * first 8 of them (TCP or UDP), and stay 0 when the quote is cut before
 * them or is a later fragment. Returns 0 with *q filled, -1 for anything
 * else. Frames come here rarely (ICMP that pt_interesting refused), so it
 * reads the frame again from the start rather than making the common path
 * keep offsets. */
static __always_inline int pt_load_icmp_quote(struct __sk_buff *skb, struct pt_tuple *q)
{
	struct ethhdr eth;
	__u16 tci, tpid;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
		return -1;
	__u32 off = sizeof(eth);
	if (pt_skip_vlans(skb, eth.h_proto, &off, &tci, &tpid) < 0)
		return -1;
	struct iphdr ip;
	if (bpf_skb_load_bytes(skb, off, &ip, sizeof(ip)) < 0 || ip.version != 4 || ip.ihl < 5 ||
	    ip.protocol != IPPROTO_ICMP || (ip.frag_off & bpf_htons(0x1fff)))
		return -1;
	off += ip.ihl * 4;
	struct pt_icmp_quote m;
	if (bpf_skb_load_bytes(skb, off, &m, sizeof(m)) < 0)
		return -1;
	if (m.icmp.type != PT_ICMP_DEST_UNREACH && m.icmp.type != PT_ICMP_TIME_EXCEEDED &&
	    m.icmp.type != PT_ICMP_PARAMETERPROB)
		return -1;
	if (m.ip.version != 4 || m.ip.ihl < 5)
		return -1;
	pt_parse_ip(q, &m.ip);
	if (m.ip.frag_off & bpf_htons(0x1fff)) /* a later fragment: no ports */
		return 0;
	off += sizeof(m.icmp) + m.ip.ihl * 4;
	__u8 l4[8];
	if ((q->proto == IPPROTO_TCP || q->proto == IPPROTO_UDP) && bpf_skb_load_bytes(skb, off, l4, sizeof(l4)) == 0) {
		q->sport = *(const __u16 *)&l4[0];
		q->dport = *(const __u16 *)&l4[2];
	}
	return 0;
}

/* A packet socket's filter sees the frame from the MAC header on (SOCK_RAW).
 * Tags the kernel moved out of band are not in it; in-band 802.1Q / 802.1ad
 * tags (up to two) are skipped. The common frame (TCP or UDP, watched or
 * not) costs one comparison more than without the ICMP errors. */
SEC("socket")
int pt_tap_filter(struct __sk_buff *skb)
{
	struct pt_tuple t;
	__u16 tci, tpid;
	if (pt_load_frame(skb, &t, &tci, &tpid) < 0)
		return 0;
	if (pt_interesting(&t))
		return tap_snaplen;
	/* An ICMP error about a watched flow, e.g. the network unreachable a
	 * router answers a request that kept the VIP as its destination. */
	if (t.proto != IPPROTO_ICMP || pt_load_icmp_quote(skb, &t) < 0 || !pt_interesting(&t))
		return 0;
	return tap_snaplen;
}

/* The conntrack event socket's filter: a ctnetlink event (nlmsghdr,
 * nfgenmsg, then the attributes, the first being the original tuple) passes
 * when its original destination is watched (the endpoint, or every port of
 * the address) or its original source is a
 * learned client endpoint, so the entry of a flow whose destination a socket
 * LB or a tc program rewrote before conntrack saw it, and that the node's
 * SNAT then gave another source, reaches user space from its first event;
 * an IPv4 event of anything else is dropped in the kernel, so a busy node's
 * conntrack churn never reaches pathtrace. A message whose addresses are
 * not laid out as expected passes, for user space to decide; one without
 * ports laid out after them (ICMP) is decided by its destination. Attribute
 * headers are
 * host-order length and type (flag bits masked off); addresses and ports
 * network order. ctnetlink_dump_tuples writes CTA_TUPLE_IP (source, then
 * destination) then CTA_TUPLE_PROTO (number, source port, destination port
 * for TCP and UDP). */
struct pt_ct_orig {
	__u8 nlmsghdr[16];
	__u8 family; /* nfgenmsg */
	__u8 nfgen_rest[3];
	struct nlattr orig;  /* CTA_TUPLE_ORIG (1) */
	struct nlattr ip;    /* CTA_TUPLE_IP (1) */
	struct nlattr src_h; /* CTA_IP_V4_SRC (1), length 8 */
	__u32 src;
	struct nlattr dst_h; /* CTA_IP_V4_DST (2), length 8 */
	__u32 dst;
	struct nlattr proto_h; /* CTA_TUPLE_PROTO (2) */
	struct nlattr num_h;   /* CTA_PROTO_NUM (1), length 5 */
	__u8 num;
	__u8 num_pad[3];
	struct nlattr sport_h; /* CTA_PROTO_SRC_PORT (2), length 6 */
	__u16 sport;
	__u16 sport_pad;
	struct nlattr dport_h; /* CTA_PROTO_DST_PORT (3), length 6 */
	__u16 dport;
	__u16 dport_pad;
};

#define PT_NLA_TYPE(a) ((a).nla_type & 0x3fff)

/* The reply tuple, which follows the original one: CTA_TUPLE_REPLY (2), laid
 * out as the original. */
struct pt_ct_reply {
	struct nlattr reply; /* CTA_TUPLE_REPLY (2) */
	struct nlattr ip;
	struct nlattr src_h;
	__u32 src;
	struct nlattr dst_h;
	__u32 dst;
	struct nlattr proto_h;
	struct nlattr num_h;
	__u8 num;
	__u8 num_pad[3];
	struct nlattr sport_h;
	__u16 sport;
	__u16 sport_pad;
	struct nlattr dport_h;
	__u16 dport;
	__u16 dport_pad;
};

/* pt_ct_ports_laid_out tells whether an event's original tuple has its
 * protocol and both ports where pt_ct_orig expects them. */
static __always_inline bool pt_ct_ports_laid_out(const struct pt_ct_orig *m)
{
	return PT_NLA_TYPE(m->proto_h) == 2 && PT_NLA_TYPE(m->num_h) == 1 && PT_NLA_TYPE(m->sport_h) == 2 &&
	       m->sport_h.nla_len == 6 && PT_NLA_TYPE(m->dport_h) == 3 && m->dport_h.nla_len == 6;
}

/* pt_ct_learn_snat learns, for the entry of a watched flow (its event
 * passes), the source the node's SNAT gave it (the reply tuple's
 * destination, when it is not the original source) as a client endpoint: the
 * taps then keep the flow's frames beyond the SNAT and their replies also
 * when their destination is watched by no one, because a tc program on the
 * uplink's egress rewrote it after netfilter, where no observer learns the
 * new destination. conntrack reports a new entry as it confirms it, at the
 * end of POSTROUTING, and this filter runs in that report, before the packet
 * reaches the uplink: its first packet is kept. */
static __always_inline void pt_ct_learn_snat(struct __sk_buff *skb, const struct pt_ct_orig *m)
{
	struct pt_ct_reply r;
	__u32 off = offsetof(struct pt_ct_orig, orig) + ((m->orig.nla_len + 3) & ~3);
	if (bpf_skb_load_bytes(skb, off, &r, sizeof(r)) < 0)
		return;
	if (PT_NLA_TYPE(r.reply) != 2 || PT_NLA_TYPE(r.ip) != 1 || r.src_h.nla_len != 8 || PT_NLA_TYPE(r.src_h) != 1 ||
	    r.dst_h.nla_len != 8 || PT_NLA_TYPE(r.dst_h) != 2 || PT_NLA_TYPE(r.proto_h) != 2 ||
	    PT_NLA_TYPE(r.num_h) != 1 || r.num != m->num || PT_NLA_TYPE(r.dport_h) != 3 || r.dport_h.nla_len != 6)
		return;
	if (r.dst == m->src && r.dport == m->sport)
		return; /* no SNAT */
	pt_learn_client(r.dst, r.dport, r.num);
}

SEC("socket")
int pt_ct_filter(struct __sk_buff *skb)
{
	struct pt_ct_orig m;
	__u32 addrs_end = offsetof(struct pt_ct_orig, proto_h);
	if (bpf_skb_load_bytes(skb, 0, &m, addrs_end) < 0)
		return skb->len; /* too short to be laid out as expected */
	if (m.family != 2 /* AF_INET */)
		return 0; /* IPv6: pathtrace traces IPv4 Services */
	if (PT_NLA_TYPE(m.orig) != 1 || PT_NLA_TYPE(m.ip) != 1 || m.src_h.nla_len != 8 ||
	    PT_NLA_TYPE(m.src_h) != 1 || m.dst_h.nla_len != 8 || PT_NLA_TYPE(m.dst_h) != 2)
		return skb->len;
	__u8 how = pt_watched_how(m.dst);
	if (how && how != PT_WATCH_ENDPOINTS)
		goto watched;
	if (bpf_skb_load_bytes(skb, 0, &m, sizeof(m)) < 0 || PT_NLA_TYPE(m.proto_h) != 2 ||
	    PT_NLA_TYPE(m.num_h) != 1 || PT_NLA_TYPE(m.sport_h) != 2 || m.sport_h.nla_len != 6)
		return how ? skb->len : 0; /* no ports (ICMP) or cut: the destination's address decided */
	if (how && PT_NLA_TYPE(m.dport_h) == 3 && m.dport_h.nla_len == 6 && pt_watched_at(m.dst, m.dport, m.num))
		goto watched;
	if (how && (PT_NLA_TYPE(m.dport_h) != 3 || m.dport_h.nla_len != 6))
		return skb->len; /* not laid out as expected: user space decides */
	if (!pt_watched_client(m.src, m.sport, m.num))
		return 0;
watched:
	if (bpf_skb_load_bytes(skb, 0, &m, sizeof(m)) == 0 && pt_ct_ports_laid_out(&m))
		pt_ct_learn_snat(skb, &m);
	return skb->len;
}
