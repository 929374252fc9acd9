/* The AF_PACKET taps' socket filter: it keeps the frames of watched flows
 * (a watched address, or a client endpoint the observers learned in the
 * kernel) and drops the rest before they are copied to user space. It shares
 * watch_addrs and watch_clients with the observers, so a tap follows a flow
 * whose destination was rewritten from the first packet after the rewrite,
 * with no user-space round trip. It only reads. */
#include "observe.h"

#define ETH_P_IP 0x0800
#define ETH_P_8021Q 0x8100
#define ETH_P_8021AD 0x88A8
#define MAX_VLAN_TAGS 2

/* Bytes kept per accepted frame; set at load time. */
volatile const __u32 tap_snaplen = 96;

/* A packet socket's filter sees the frame from the MAC header on (SOCK_RAW).
 * Tags the kernel moved out of band are not in it; in-band 802.1Q / 802.1ad
 * tags (up to two) are skipped. */
SEC("socket")
int pt_tap_filter(struct __sk_buff *skb)
{
	__u32 off = 12; /* EtherType */
	__u16 proto;
	if (bpf_skb_load_bytes(skb, off, &proto, sizeof(proto)) < 0)
		return 0;
	off += sizeof(proto);
	for (int i = 0; i < MAX_VLAN_TAGS; i++) {
		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		/* TCI, then the next EtherType. */
		if (bpf_skb_load_bytes(skb, off + 2, &proto, sizeof(proto)) < 0)
			return 0;
		off += 4;
	}
	if (proto != bpf_htons(ETH_P_IP))
		return 0;

	struct pt_tuple t;
	if (pt_load_ipv4(skb, off, &t) < 0 || !pt_interesting(&t))
		return 0;
	return tap_snaplen;
}
