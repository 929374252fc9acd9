/* tc bracket: tcx observers at the head and the tail of an interface's
 * ingress and egress chains. They return TCX_NEXT so the rest of the chain
 * (the program that may rewrite the packet) always runs. */
#include "observe.h"

#define ETH_P_IP 0x0800
#define ETH_P_8021Q 0x8100
#define ETH_P_8021AD 0x88A8

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

/* learn: this observer is the first to see a flow from the Pod (head of
 * ingress), so it records the client endpoint of packets to a watched
 * address for the points after a possible rewrite. */
static __always_inline int pt_tc_observe(struct __sk_buff *skb, __u8 point, __u8 dir, bool learn)
{
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
		return TCX_NEXT;

	__u32 off = sizeof(eth);
	__u16 proto = bpf_ntohs(eth.h_proto);
	__u16 vlan_tci = 0, vlan_proto = 0;
	if (skb->vlan_present) { /* tag carried out of band */
		vlan_tci = skb->vlan_tci;
		vlan_proto = bpf_ntohs(skb->vlan_proto);
	}
	if (proto == ETH_P_8021Q || proto == ETH_P_8021AD) { /* one in-band tag */
		struct vlan_hdr vh;
		if (bpf_skb_load_bytes(skb, off, &vh, sizeof(vh)) < 0)
			return TCX_NEXT;
		if (!vlan_proto) {
			vlan_tci = bpf_ntohs(vh.h_vlan_TCI);
			vlan_proto = proto;
		}
		proto = bpf_ntohs(vh.h_vlan_encapsulated_proto);
		off += sizeof(vh);
	}
	if (proto != ETH_P_IP)
		return TCX_NEXT;

	struct pt_tuple t;
	if (pt_load_ipv4(skb, off, &t) < 0)
		return TCX_NEXT;
	if (learn && pt_watched(t.daddr))
		pt_learn_client(t.saddr, t.sport, t.proto);
	if (!pt_interesting(&t) || !pt_within_budget(&t, point, dir))
		return TCX_NEXT;

	struct pt_event *e = pt_reserve(point);
	if (!e)
		return TCX_NEXT;
	pt_set_tuple(e, &t);
	e->dir = dir;
	e->len = skb->len;
	e->ifindex = skb->ifindex;
	e->vlan_tci = vlan_tci;
	e->vlan_proto = vlan_proto;
	struct sk_buff *kskb = bpf_cast_to_kern_ctx(skb);
	e->netns = BPF_CORE_READ(kskb, dev, nd_net.net, ns.inum);
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
