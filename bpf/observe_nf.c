/* netfilter bracket: BPF netfilter programs attached to one hook just below
 * (before) and just above (after) the NAT priority. A destination that differs
 * between the two was rewritten by NAT at that hook. They always accept. */
#include "observe.h"

#define NF_ACCEPT 1

extern int bpf_dynptr_from_skb(struct __sk_buff *skb, __u64 flags,
			       struct bpf_dynptr *ptr__uninit) __ksym;
extern void *bpf_dynptr_slice(const struct bpf_dynptr *ptr, __u32 offset, void *buffer__opt,
			      __u32 buffer__szk) __ksym;

/* pt_nf_tuple reads the IPv4 header (at the inet hooks skb->data is the IP
 * header) and the TCP/UDP ports. Returns -1 when the packet is not IPv4. */
static __always_inline int pt_nf_tuple(struct bpf_dynptr *ptr, struct pt_tuple *t)
{
	struct iphdr ipbuf;
	struct iphdr *ip = bpf_dynptr_slice(ptr, 0, &ipbuf, sizeof(ipbuf));
	if (!ip || ip->version != 4)
		return -1;
	pt_parse_ip(t, ip);
	if (ip->frag_off & bpf_htons(0x1fff)) /* not the first fragment */
		return 0;
	__u32 l4off = ip->ihl * 4;
	__u8 buf[14]; /* through the TCP flags; a UDP header is 8 bytes */
	const __u8 *l4;
	if (t->proto == IPPROTO_TCP && (l4 = bpf_dynptr_slice(ptr, l4off, buf, 14)))
		pt_parse_l4(t, l4, 14);
	else if (t->proto == IPPROTO_UDP && (l4 = bpf_dynptr_slice(ptr, l4off, buf, 8)))
		pt_parse_l4(t, l4, 8);
	return 0;
}

/* learn: the observer before NAT records the client endpoint of packets to a
 * watched address, so the one after NAT (and every later point) follows the
 * flow to a backend no rule named. */
static __always_inline int pt_nf_observe(struct bpf_nf_ctx *ctx, __u8 point, bool learn)
{
	struct bpf_dynptr ptr;
	if (bpf_dynptr_from_skb((struct __sk_buff *)ctx->skb, 0, &ptr))
		return NF_ACCEPT;
	struct pt_tuple t;
	if (pt_nf_tuple(&ptr, &t) < 0)
		return NF_ACCEPT;
	struct pt_quiet *quiet;
	if (pt_quiet_packet(&t, point, ctx->state->hook, &quiet))
		return NF_ACCEPT;
	bool dst_watched = pt_watched_at(t.daddr, t.dport, t.proto);
	/* A packet of a connection's reply direction, per conntrack (which ran
	 * before, at priority -200): its source is no client. */
	enum ip_conntrack_info ct = ctx->skb->_nfct & 7; /* NFCT_INFOMASK */
	bool reply = ct == IP_CT_ESTABLISHED_REPLY || ct == IP_CT_RELATED_REPLY;
	if (learn && dst_watched && !reply)
		pt_learn_client(t.saddr, t.sport, t.proto);
	if (!(dst_watched || pt_interesting_but_dst(&t)))
		return NF_ACCEPT;
	/* Before NAT: a packet a tc program rewrote on its way here, or one to
	 * a watched address NAT may rewrite next; after NAT: what NAT chose,
	 * or the end of the packet's walk past the observers. Only packets of
	 * a connection's original direction: NAT rewrites a reply's
	 * destination back to the address the node's SNAT replaced (a Pod's,
	 * or a NodePort client's when the VIP is the node's address), which
	 * is no backend. */
	__u64 skb = (__u64)ctx->skb, now = bpf_ktime_get_ns();
	if (reply)
		pt_forget_to_watched(skb);
	else if (!dst_watched)
		pt_learn_rewrite(skb, &t, now);
	else if (learn)
		pt_note_to_watched(skb, &t, now);
	else
		pt_forget_to_watched(skb);
	if (!pt_budget_quiet(quiet, &t, point, ctx->state->hook, now))
		return NF_ACCEPT;

	struct pt_event *e = pt_reserve_at(point, now);
	if (!e)
		return NF_ACCEPT;
	pt_set_tuple(e, &t);
	const struct nf_hook_state *state = ctx->state;
	struct net_device *dev = state->in ? state->in : state->out;
	e->hook = state->hook;
	e->netns = state->net->ns.inum; /* trusted pointers: plain loads */
	e->ifindex = dev ? dev->ifindex : 0;
	e->len = ctx->skb->len;
	/* A node socket's packet at OUTPUT: its cookie ties the socket (whose
	 * port the socket observers may never learn: a rule at OUTPUT that
	 * drops its SYN keeps it from the egress hook) to the flow. A cookie
	 * is made at the socket's first connect/sendmsg observation; 0 when
	 * none was. */
	struct sock *sk = ctx->skb->sk;
	if (state->hook == NF_INET_LOCAL_OUT && !reply && sk)
		e->cookie = sk->__sk_common.skc_cookie.counter;
	pt_submit(e);
	return NF_ACCEPT;
}

SEC("netfilter")
int pt_nf_before(struct bpf_nf_ctx *ctx)
{
	return pt_nf_observe(ctx, PT_NF_BEFORE, true);
}

SEC("netfilter")
int pt_nf_after(struct bpf_nf_ctx *ctx)
{
	return pt_nf_observe(ctx, PT_NF_AFTER, false);
}
