/* tc bracket: tcx observers at the head and the tail of an interface's
 * ingress and egress chains. They return TCX_NEXT so the rest of the chain
 * (the program that may rewrite the packet) always runs. */
#include "observe.h"

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

/* learn: this observer is the first to see a flow from the Pod (head of
 * ingress), so it records the client endpoint of packets to a watched
 * address for the points after a possible rewrite. */
/* pt_tc_load_frame is pt_load_frame reading the headers in place when they
 * are in the linear data (tc programs may), which spares the helper call on
 * almost every packet. */
static __always_inline int pt_tc_load_frame(struct __sk_buff *skb, struct pt_tuple *t, __u16 *tci, __u16 *tpid)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + sizeof(*eth);
	__u8 *l4 = (__u8 *)(ip + 1);
	if ((void *)(l4 + 14) <= end && eth->h_proto == bpf_htons(ETH_P_IP) && ip->version == 4 && ip->ihl == 5 &&
	    !(ip->frag_off & bpf_htons(0x1fff))) {
		*tci = *tpid = 0;
		pt_parse_ip(t, ip);
		pt_parse_l4(t, l4, 14);
		return 0;
	}
	return pt_load_frame(skb, t, tci, tpid);
}

static __always_inline int pt_tc_observe(struct __sk_buff *skb, __u8 point, __u8 dir, bool learn)
{
	struct pt_tuple t;
	__u16 vlan_tci, vlan_proto;
	if (pt_tc_load_frame(skb, &t, &vlan_tci, &vlan_proto) < 0)
		return TCX_NEXT;
	struct pt_quiet *quiet;
	if (pt_quiet_packet(&t, point, dir, &quiet))
		return TCX_NEXT;
	if (skb->vlan_present) { /* the outer tag, carried out of band */
		vlan_tci = skb->vlan_tci;
		vlan_proto = bpf_ntohs(skb->vlan_proto);
	}
	bool dst_watched = pt_watched_at(t.daddr, t.dport, t.proto);
	if (learn && dst_watched)
		pt_learn_client(t.saddr, t.sport, t.proto);
	if (!(dst_watched || pt_interesting_but_dst(&t)))
		return TCX_NEXT;
	/* A trusted pointer: plain loads, no probe-read helper calls. */
	struct sk_buff *kskb = bpf_cast_to_kern_ctx(skb);
	__u64 now = bpf_ktime_get_ns();
	if (dir == PT_DIR_IN) { /* from the Pod: before and after its rewrite at tc */
		if (learn && dst_watched)
			pt_note_to_watched((__u64)kskb, &t, now);
		else if (learn) /* a packet of the Pod to elsewhere: no earlier note holds */
			pt_forget_to_watched(0);
		else if (!dst_watched)
			pt_learn_rewrite((__u64)kskb, &t, now);
	}
	if (!pt_budget_quiet(quiet, &t, point, dir, now))
		return TCX_NEXT;

	struct pt_event *e = pt_reserve_at(point, now);
	if (!e)
		return TCX_NEXT;
	pt_set_tuple(e, &t);
	e->dir = dir;
	e->len = skb->len;
	e->ifindex = skb->ifindex;
	e->vlan_tci = vlan_tci;
	e->vlan_proto = vlan_proto;
	e->netns = kskb->dev->nd_net.net->ns.inum;
	pt_submit(e);
	return TCX_NEXT;
}

SEC("tcx/ingress")
int pt_tc_head_in(struct __sk_buff *skb)
{
	return pt_tc_observe(skb, PT_TC_HEAD, PT_DIR_IN, true);
}

SEC("tcx/ingress")
int pt_tc_tail_in(struct __sk_buff *skb)
{
	return pt_tc_observe(skb, PT_TC_TAIL, PT_DIR_IN, false);
}

SEC("tcx/egress")
int pt_tc_head_out(struct __sk_buff *skb)
{
	return pt_tc_observe(skb, PT_TC_HEAD, PT_DIR_OUT, false);
}

SEC("tcx/egress")
int pt_tc_tail_out(struct __sk_buff *skb)
{
	return pt_tc_observe(skb, PT_TC_TAIL, PT_DIR_OUT, false);
}
