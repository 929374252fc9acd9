/* Drop observer: the skb:kfree_skb tracepoint, which the kernel fires when
 * it frees a packet it did not deliver, with its reason (enum
 * skb_drop_reason) and the address of the code that dropped it. Only
 * packets the other observers would report (pt_interesting) are reported,
 * within their flow direction's budget. It only looks. */
#include "observe.h"
#include "headers/bpf_tracing.h"
#include "headers/bpf_core_read.h"

#define AF_PACKET 17
#define PT_KSYM_LEN 128 /* KSYM_NAME_LEN (512) is the bound; function names are far shorter */

extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym;

/* pt_skb_tuple reads the IPv4 header at skb's network header and the TCP or
 * UDP ports after it. Returns -1 when the packet is not IPv4 (or its
 * headers cannot be read). The headers are read through untrusted casts
 * (plain loads the kernel guards against faults: one that faults reads 0)
 * rather than with bpf_probe_read_kernel: this runs for every packet the
 * node drops, and took ~95 ns a run instead of ~150 here. */
static __always_inline int pt_skb_tuple(struct sk_buff *skb, struct pt_tuple *t, __u32 *payload)
{
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return -1;
	unsigned char *nh = skb->head + skb->network_header;
	struct iphdr *ip = bpf_rdonly_cast(nh, bpf_core_type_id_kernel(struct iphdr));
	if (ip->version != 4 || ip->ihl < 5)
		return -1;
	pt_parse_ip(t, ip);
	if (ip->frag_off & bpf_htons(0x1fff)) /* not the first fragment */
		return 0;
	struct tcphdr *l4 = bpf_rdonly_cast(nh + ip->ihl * 4, bpf_core_type_id_kernel(struct tcphdr));
	if (ip->protocol == IPPROTO_TCP || ip->protocol == IPPROTO_UDP) {
		/* A UDP header's ports are where TCP's are. */
		t->sport = l4->source;
		t->dport = l4->dest;
		if (ip->protocol == IPPROTO_TCP) {
			t->tcp_flags = ((const __u8 *)l4)[13]; /* FIN, SYN, RST, ... */
			*payload = bpf_ntohs(ip->tot_len) - ip->ihl * 4 - (((const __u8 *)l4)[12] >> 4) * 4;
		}
	}
	return 0;
}

/* Left out: SKB_CONSUMED (a packet freed after its use, not dropped),
 * QUEUE_PURGE (a queue emptied as its socket or device goes away), every
 * packet freed by a packet socket (rx_sk an AF_PACKET socket): the copies
 * the taps, pathtrace's or tcpdump's, were given, whose losses their own
 * counters report, the packet itself went on; and the segments without
 * data or SYN a TIME_WAIT socket took (an orphaned FIN_WAIT2 one is one: a
 * peer's FIN after the socket closed), which it answered before tcp_v4_rcv
 * freed them with no reason (NOT_SPECIFIED). It frees so, too, the data
 * and the SYN it refused (a request on a connection the server closed,
 * reset; a SYN no listener took): those are drops. The reasons' numbers are
 * the running kernel's (CO-RE enum value relocations, resolved at load):
 * enum skb_drop_reason grows in its middle between kernel releases
 * (QUEUE_PURGE is 104 in the headers built against, 105 on 6.18.44). */
SEC("tp_btf/kfree_skb")
int BPF_PROG(pt_drop, struct sk_buff *skb, void *location, enum skb_drop_reason reason, struct sock *rx_sk)
{
	if (reason == bpf_core_enum_value(enum skb_drop_reason, SKB_CONSUMED) ||
	    reason == bpf_core_enum_value(enum skb_drop_reason, SKB_DROP_REASON_QUEUE_PURGE))
		return 0;
	if (rx_sk && rx_sk->__sk_common.skc_family == AF_PACKET)
		return 0;
	/* Only TCP and UDP packets with their ports: a flow is made of them
	 * (a packet without, ICMP or a later fragment, is no flow's). This
	 * also leaves out the buffer a route lookup builds and frees
	 * (RTM_GETROUTE, which pathtrace's discovery asks for): it has a
	 * watched address but no ports, and is no packet. */
	struct pt_tuple t;
	__u32 payload = 0;
	if (pt_skb_tuple(skb, &t, &payload) < 0 || !pt_has_ports(t.sport, t.proto) || !t.dport || !pt_interesting(&t))
		return 0;
	if (rx_sk && rx_sk->__sk_common.skc_state == TCP_TIME_WAIT && !payload && !(t.tcp_flags & 0x02) /* SYN */ &&
	    reason == bpf_core_enum_value(enum skb_drop_reason, SKB_DROP_REASON_NOT_SPECIFIED))
		return 0;
	/* Every drop counts against the budget, TCP control packets too: a
	 * flood of dropped SYNs must not flood the ring. */
	__u64 now = bpf_ktime_get_ns();
	if (!pt_take_budget(&t, PT_DROP, 0, now))
		return 0;

	struct pt_event *e = pt_reserve_at(PT_DROP, now);
	if (!e)
		return 0;
	pt_set_tuple(e, &t);
	e->len = skb->len;
	e->drop_reason = reason;
	e->location = (__u64)location;
	struct net_device *dev = skb->dev;
	struct sock *sk = skb->sk;
	if (dev) {
		e->ifindex = dev->ifindex;
		e->netns = dev->nd_net.net->ns.inum;
	} else {
		e->ifindex = skb->skb_iif; /* the device it came in by, 0 for a local one */
		if (sk)
			e->netns = sk->__sk_common.skc_net.net->ns.inum;
	}
	pt_submit(e);
	return 0;
}

/* pt_ksym names a kernel text address, a drop event's location, through the
 * kernel's own symbol lookup (%ps: "function" or "function [module]"): run
 * on demand with BPF_PROG_RUN, it takes microseconds, where reading
 * /proc/kallsyms (the kernel formats every symbol) takes tens of
 * milliseconds of CPU. An address that is no symbol prints as 0x...; the
 * caller takes that as unknown. */
struct pt_ksym_ctx {
	__u64 addr;
	char name[PT_KSYM_LEN];
};

SEC("syscall")
int pt_ksym(struct pt_ksym_ctx *ctx)
{
	__u64 args[1] = { ctx->addr };
	char name[PT_KSYM_LEN] = {}; /* the helper writes to the stack, not the context */
	bpf_snprintf(name, sizeof(name), "%ps", args, sizeof(args));
	__builtin_memcpy(ctx->name, name, sizeof(name));
	return 0;
}
