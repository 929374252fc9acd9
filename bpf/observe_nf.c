/* netfilter bracket: BPF netfilter programs attached to one hook just below
 * (before) and just above (after) the NAT priority. A destination that differs
 * between the two was rewritten by NAT at that hook. They always accept. */
#include "observe.h"

#define NF_ACCEPT 1

extern int bpf_dynptr_from_skb(struct __sk_buff *skb, __u64 flags,
			       struct bpf_dynptr *ptr__uninit) __ksym;
extern void *bpf_dynptr_slice(const struct bpf_dynptr *ptr, __u32 offset, void *buffer__opt,
			      __u32 buffer__szk) __ksym;

/* L4 ports; the TCP flags byte sits at offset 13 of the TCP header. */
struct pt_l4 {
	__be16 sport;
	__be16 dport;
	__u8 _seq_ack[9];
	__u8 tcp_flags;
};

static __always_inline int pt_nf_observe(struct bpf_nf_ctx *ctx, __u8 point)
{
	struct bpf_dynptr ptr;
	if (bpf_dynptr_from_skb((struct __sk_buff *)ctx->skb, 0, &ptr))
		return NF_ACCEPT;

	/* At the inet hooks skb->data is the IP header. */
	struct iphdr ipbuf;
	struct iphdr *ip = bpf_dynptr_slice(&ptr, 0, &ipbuf, sizeof(ipbuf));
	if (!ip || ip->version != 4 || (!pt_watched(ip->daddr) && !pt_watched(ip->saddr)))
		return NF_ACCEPT;

	struct pt_event *e = pt_reserve(point);
	if (!e)
		return NF_ACCEPT;
	e->saddr = ip->saddr;
	e->daddr = ip->daddr;
	e->proto = ip->protocol;
	if (!(ip->frag_off & bpf_htons(0x1fff)) &&
	    (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP)) {
		__u32 l4off = ip->ihl * 4;
		if (ip->protocol == IPPROTO_TCP) {
			struct pt_l4 l4buf;
			struct pt_l4 *l4 = bpf_dynptr_slice(&ptr, l4off, &l4buf, sizeof(l4buf));
			if (l4) {
				e->sport = l4->sport;
				e->dport = l4->dport;
				e->tcp_flags = l4->tcp_flags;
			}
		} else {
			struct udphdr ubuf;
			struct udphdr *udp = bpf_dynptr_slice(&ptr, l4off, &ubuf, sizeof(ubuf));
			if (udp) {
				e->sport = udp->source;
				e->dport = udp->dest;
			}
		}
	}

	const struct nf_hook_state *state = ctx->state;
	struct net_device *dev = state->in ? state->in : state->out;
	e->hook = state->hook;
	e->netns = BPF_CORE_READ(state, net, ns.inum);
	e->ifindex = dev ? BPF_CORE_READ(dev, ifindex) : 0;
	e->len = BPF_CORE_READ(ctx->skb, len);
	bpf_ringbuf_submit(e, 0);
	return NF_ACCEPT;
}

SEC("netfilter")
int pt_nf_before(struct bpf_nf_ctx *ctx)
{
	return pt_nf_observe(ctx, PT_NF_BEFORE);
}

SEC("netfilter")
int pt_nf_after(struct bpf_nf_ctx *ctx)
{
	return pt_nf_observe(ctx, PT_NF_AFTER);
}
