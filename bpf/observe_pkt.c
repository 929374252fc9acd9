/* The AF_PACKET taps' socket filter: it keeps the frames of watched flows
 * (a watched address, or a client endpoint the observers learned in the
 * kernel), and the ICMP errors about them, and drops the rest before they
 * are copied to user space. It shares watch_addrs and watch_clients with the
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
