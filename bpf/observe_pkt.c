/* The AF_PACKET taps' socket filter: it keeps the frames of watched flows
 * (a watched address, or a client endpoint the observers learned in the
 * kernel) and drops the rest before they are copied to user space. It shares
 * watch_addrs and watch_clients with the observers, so a tap follows a flow
 * whose destination was rewritten from the first packet after the rewrite,
 * with no user-space round trip. It only reads. */
#include "observe.h"

/* Bytes kept per accepted frame; set at load time. */
volatile const __u32 tap_snaplen = 96;

/* A packet socket's filter sees the frame from the MAC header on (SOCK_RAW).
 * Tags the kernel moved out of band are not in it; in-band 802.1Q / 802.1ad
 * tags (up to two) are skipped. */
SEC("socket")
int pt_tap_filter(struct __sk_buff *skb)
{
	struct pt_tuple t;
	__u16 tci, tpid;
	if (pt_load_frame(skb, &t, &tci, &tpid) < 0 || !pt_interesting(&t))
		return 0;
	return tap_snaplen;
}
