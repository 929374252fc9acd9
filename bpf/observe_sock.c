/* Socket bracket: what the application asked for (the syscall's own
 * arguments in user memory) against what the socket uses (cgroup
 * connect4/sendmsg4 run after every socket-LB program that precedes this
 * observer in the cgroup order, which rewrote the kernel's copy), then the
 * socket's first packet and its TCP SYN_SENT state, which tie the socket
 * cookie to the packet 4-tuple. x86-64 syscall numbers and registers.
 *
 * They also teach the other points, in the kernel and before the packet
 * reaches them: the backend a socket LB chose (watch_endpoints) and the client
 * endpoint of the first packet (watch_clients). */
#include "observe.h"
#include "headers/bpf_tracing.h"

#define AF_INET 2
#define AF_INET6 10
#define SYS_CONNECT 42
#define SYS_SENDTO 44
#define SYS_SENDMSG 46
#define SYS_SENDMMSG 307
#define PF_IO_WORKER 0x00000010 /* include/linux/sched.h */
#define PF_KTHREAD 0x00200000

/* Sockets that connected or sent to a watched address and whose first packet
 * has not been seen yet, in tables of 4-way sets (observe.h's pt_set): a
 * slot holds a socket cookie, the netns inode of the socket's creator and
 * when it was watched. connect4 and sendmsg4 write a slot with plain stores
 * and two exchanges, where an LRU hash map's insert (its locks and free
 * lists) cost them ~0.8 us per connection; the egress observer claims it
 * with one compare-and-swap. A slot is freed when claimed, so what stays is
 * a socket that never sent (a UDP socket connected only to learn its source
 * address) or closed without sending, which a new watch then replaces
 * first. A TCP socket sends its first packet microseconds after its watch
 * (in the same connect call), but a pool of connected UDP sockets may all
 * wait to send at once: a slot taken by later watches before its socket
 * sent is counted in learn_errors (replaced within PT_COOKIE_LIVE_MS of its
 * watch), and that flow lacks its socket's tuple. With 500 UDP sockets
 * connected before any sent, none are lost (odds of one ~1/100000), with
 * 2000, 5 to 20 in runs here (8 tables lost one, but cost connect4 ~0.4 us
 * more per connection: the more memory a lookup may land in, the more
 * often it misses the caches). The set is also the egress observer's first
 * test, for every packet of every socket under the cgroup: one cache line,
 * as a bit array was. Cookies are never reused: a stale slot matches no
 * other socket. */
#define PT_COOKIE_LIVE_MS 1000

/* The netns of a watch that sendmsg4 made for a datagram to a destination
 * the socket sent to before (no netns is 0): its egress is reported only
 * when it leaves for a destination new for the socket. */
#define PT_NETNS_SENT_AGAIN 0

PT_SET_TABLES(watch_cookies); /* key: the cookie; stamp: when watched; val: the netns */

static __always_inline struct pt_set *pt_cookie_set(__u64 cookie)
{
	return PT_SET_OF(watch_cookies, pt_mix((__u32)cookie ^ pt_mix(cookie >> 32)));
}

/* pt_watch_cookie watches the socket cookie (netns: its creator's), at now.
 * The slot is emptied before its netns changes and the cookie published
 * after (exchanges: full barriers), so pt_claim_cookie never pairs a cookie
 * with another socket's netns. */
static __always_inline void pt_watch_cookie(__u64 cookie, __u32 netns, __u64 now)
{
	struct pt_set *set = pt_cookie_set(cookie);
	if (!set)
		return;
	__u32 now_ms = pt_coarse_ms(now);
	struct pt_slot *victim, *s = pt_set_find(set, cookie, now_ms, &victim);
	if (!s) {
		s = victim;
		if (s->key && pt_age(now_ms, s->stamp) < PT_COOKIE_LIVE_MS)
			pt_count_learn_error(); /* a socket watched just now may lose its first packet */
	}
	__sync_lock_test_and_set(&s->key, 0);
	s->val = netns;
	s->stamp = now_ms;
	__sync_lock_test_and_set(&s->key, cookie);
}

/* pt_claim_cookie takes the watch of the socket cookie, once (an observer of
 * another CPU that claims it too gets false), with the netns it was watched
 * in: true once after each pt_watch_cookie of it. */
static __always_inline bool pt_claim_cookie(__u64 cookie, __u32 *netns)
{
	if (!cookie)
		return false;
	struct pt_set *set = pt_cookie_set(cookie);
	if (!set)
		return false;
#pragma unroll
	for (int i = 0; i < PT_WAYS; i++) {
		struct pt_slot *s = &set->way[i];
		if (*(volatile __u64 *)&s->key != cookie)
			continue;
		/* Read before the claim: a watch that takes the slot empties
		 * it before it writes its netns, so a claim that succeeds read
		 * this socket's. */
		__u32 n = *(volatile __u32 *)&s->val;
		if (__sync_val_compare_and_swap(&s->key, cookie, 0) != cookie)
			return false;
		*netns = n;
		return true;
	}
	return false;
}

/* read_requested (key 0) is 1 while another sock_addr program may rewrite
 * destinations on this node (a socket LB): only then does the requested
 * destination differ from the one the hook sees, and need reading from the
 * syscall's arguments. User space sets it (1 until it has looked). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} read_requested SEC(".maps");

static __always_inline bool pt_must_read_requested(void)
{
	__u32 key = 0;
	__u32 *v = bpf_map_lookup_elem(&read_requested, &key);
	return !v || *v;
}

/* The first 8 bytes of a sockaddr_in: family, port, address. */
struct pt_sockaddr_in {
	__u16 family;
	__u16 port;
	__u32 addr;
};

/* sockaddr_in6 up to the address. */
struct pt_sockaddr_in6 {
	__u16 family;
	__u16 port;
	__u32 flowinfo;
	__u32 addr[4];
};

/* An IPv4-mapped IPv6 address (::ffff:a.b.c.d) is how dual-stack sockets
 * (Go's and Java's defaults) reach IPv4 destinations. */
static __always_inline bool pt_v4mapped(const __u32 addr[4])
{
	return addr[0] == 0 && addr[1] == 0 && addr[2] == bpf_htonl(0xffff);
}

/* pt_read_sockaddr reads an AF_INET or v4-mapped AF_INET6 user sockaddr;
 * false for anything else. */
static __always_inline bool pt_read_sockaddr(const void *uaddr, __u32 *addr, __u16 *port)
{
	struct pt_sockaddr_in sa;
	if (bpf_probe_read_user(&sa, sizeof(sa), uaddr))
		return false;
	if (sa.family == AF_INET) {
		*addr = sa.addr;
		*port = sa.port;
		return true;
	}
	struct pt_sockaddr_in6 sa6;
	if (sa.family != AF_INET6 || bpf_probe_read_user(&sa6, sizeof(sa6), uaddr) ||
	    !pt_v4mapped(sa6.addr))
		return false;
	*addr = sa6.addr[3];
	*port = sa6.port;
	return true;
}

/* The msg_name of a user msghdr. */
static __always_inline const void *pt_msg_name(const struct user_msghdr *msg)
{
	void *name = NULL;
	if (!msg || bpf_probe_read_user(&name, sizeof(name), &msg->msg_name))
		return NULL;
	return name;
}

/* The messages of a sendmmsg checked for one destination. */
#define PT_MMSG_MAX 4

/* pt_mmsg_name is the destination of a sendmmsg whose messages (at most
 * PT_MMSG_MAX) all go to the same one, as the resolver's A and AAAA queries
 * do; NULL otherwise: the hook cannot tell which message it runs for. */
static __always_inline const void *pt_mmsg_name(const struct mmsghdr *vec, __u64 vlen)
{
	if (!vec || vlen == 0 || vlen > PT_MMSG_MAX)
		return NULL;
	const void *first = pt_msg_name(&vec[0].msg_hdr);
	__u32 addr0, addr;
	__u16 port0, port;
	if (!first || !pt_read_sockaddr(first, &addr0, &port0))
		return NULL;
	for (int i = 1; i < PT_MMSG_MAX; i++) {
		if (i >= vlen)
			break;
		const void *name = pt_msg_name(&vec[i].msg_hdr);
		if (!name || !pt_read_sockaddr(name, &addr, &port) || addr != addr0 || port != port0)
			return NULL;
	}
	return first;
}

/* pt_requested reads the destination the application asked for: the user
 * sockaddr of the syscall this hook runs in, found in the registers the task
 * saved when it entered the kernel. Socket-LB programs rewrite the kernel's
 * copy only, so this is what the application asked for whichever ran
 * before. No syscall hook is needed: nothing runs for the node's other
 * syscalls. False when the hook does not run in such a syscall of the
 * current task (kernel threads, io_uring workers). */
static __always_inline bool pt_requested(__u32 *addr, __u16 *port)
{
	/* Trusted pointers, here and below: plain loads, no probe-read helper
	 * calls. */
	struct task_struct *task = bpf_get_current_task_btf();
	/* Kernel threads and io_uring workers have no syscall of their own in
	 * their saved registers. */
	if (task->flags & (PF_KTHREAD | PF_IO_WORKER))
		return false;
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	const void *uaddr = NULL;
	switch (regs->orig_ax) {
	case SYS_CONNECT: /* connect(fd, addr, len) */
		uaddr = (const void *)regs->si;
		break;
	case SYS_SENDTO: /* sendto(fd, buf, len, flags, addr, addrlen) */
		uaddr = (const void *)regs->r8;
		break;
	case SYS_SENDMSG: /* sendmsg(fd, msg, flags) */
		uaddr = pt_msg_name((const void *)regs->si);
		break;
	case SYS_SENDMMSG: /* sendmmsg(fd, msgvec, vlen, flags) */
		uaddr = pt_mmsg_name((const void *)regs->si, regs->dx);
		break;
	}
	return uaddr && pt_read_sockaddr(uaddr, addr, port);
}

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

/* The netns the socket lives in: a thread may send on a socket it made in
 * another netns than its own. */
static __always_inline __u32 pt_sock_netns(struct bpf_sock_addr *ctx)
{
	struct bpf_sock_addr_kern *k = bpf_cast_to_kern_ctx(ctx);
	return k->sk->__sk_common.skc_net.net->ns.inum;
}

/* The network namespaces (inodes) whose sockets teach the other points,
 * once user space has set them (key 0 present): the traced node's and its
 * Pods'. These observers see every socket of the host, and the same
 * addresses can live in netns of another node there (two kind clusters'
 * Pod CIDRs): that node's clients would have the traced node's packets of
 * the same endpoints captured, to any port. Their events still come (user
 * space counts them out of scope, or holds them for a Pod not found yet). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
} scope_netns SEC(".maps");

static __always_inline bool pt_learns_from(__u32 netns)
{
	__u32 scoped = 0;
	return !bpf_map_lookup_elem(&scope_netns, &scoped) || (netns && bpf_map_lookup_elem(&scope_netns, &netns));
}

static __always_inline void pt_set_task(struct pt_event *e, __u64 pid_tgid)
{
	e->pid = pid_tgid >> 32;
	e->cgroup_id = bpf_get_current_cgroup_id();
	bpf_get_current_comm(e->comm, sizeof(e->comm));
}

/* The destinations each unconnected UDP socket already sent to: as its
 * sendmsg4 observer saw them, and as its datagrams left. */
struct pt_sock_dst {
	__u64 cookie;
	__u32 daddr;
	__u16 dport;
	__u16 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct pt_sock_dst);
	__type(value, __u8);
} sent_to SEC(".maps");

static __always_inline bool pt_sent_before(__u64 cookie, __u32 daddr, __u16 dport)
{
	struct pt_sock_dst k = {.cookie = cookie, .daddr = daddr, .dport = dport};
	__u8 one = 1;
	if (bpf_map_lookup_elem(&sent_to, &k))
		return true;
	bpf_map_update_elem(&sent_to, &k, &one, BPF_ANY);
	return false;
}

/* The destination each unconnected UDP socket's sendmsg4 observer last saw
 * it send to again: the one whose datagram a socket LB after the observer
 * may send to another backend, which the egress observer reports with it
 * (a socket may send to several VIPs, each with backends of its own). */
struct pt_dst {
	__u32 daddr;
	__u16 dport;
	__u16 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct pt_dst);
} sent_again SEC(".maps");

/* pt_sock_addr observes a connect or sendmsg whose effective IPv4
 * destination is daddr (the address every earlier sock_addr program left). */
static __always_inline int pt_sock_addr(struct bpf_sock_addr *ctx, __u8 kind, __u32 daddr)
{
	/* With no other sock_addr program on the node, nothing rewrote the
	 * destination: it is the one requested. */
	__u32 req_daddr = daddr;
	__u16 req_dport = (__u16)ctx->user_port;
	if (pt_must_read_requested() && !pt_requested(&req_daddr, &req_dport))
		req_daddr = req_dport = 0;

	__u16 dport = (__u16)ctx->user_port;
	__u8 proto = ctx->protocol;
	bool req_watched = pt_watched_at(req_daddr, req_dport, proto);
	if (!req_watched && !pt_watched_at(daddr, dport, proto))
		return 1;
	/* A socket LB rewrote a watched destination: follow the backend
	 * endpoint from the connection's first packet on, at every later
	 * point. */
	if (req_watched && (daddr != req_daddr || dport != req_dport) && pt_learns_from(pt_sock_netns(ctx)))
		pt_learn_endpoint(daddr, dport, proto);

	__u64 cookie = bpf_get_socket_cookie(ctx);
	/* An unconnected UDP socket sending again to the same destination is the
	 * same flow: reported once, not once per datagram. But a socket LB that
	 * runs after this observer (attached after it on the same cgroup, maybe
	 * a moment ago: read_requested may not say so yet) may send each
	 * datagram to another backend: the egress observer reports the datagram
	 * when its destination is new for the socket. */
	if (kind == PT_KIND_SENDMSG && pt_sent_before(cookie, daddr, dport)) {
		/* Written when it changes: a socket sends to one VIP mostly,
		 * and a lookup costs less than an LRU update. */
		struct pt_dst d = {.daddr = daddr, .dport = dport};
		struct pt_dst *last = bpf_map_lookup_elem(&sent_again, &cookie);
		if (!last || last->daddr != daddr || last->dport != dport)
			bpf_map_update_elem(&sent_again, &cookie, &d, BPF_ANY);
		pt_watch_cookie(cookie, PT_NETNS_SENT_AGAIN, bpf_ktime_get_ns());
		return 1;
	}
	__u32 netns = pt_sock_netns(ctx);
	__u64 now = bpf_ktime_get_ns();
	pt_watch_cookie(cookie, netns, now);

	struct pt_event *e = pt_reserve_at(PT_SOCKADDR, now);
	if (!e)
		return 1;
	e->kind = kind;
	e->proto = proto;
	e->daddr = daddr;
	e->dport = dport;
	e->req_daddr = req_daddr;
	e->req_dport = req_dport;
	e->cookie = cookie;
	e->netns = netns;
	pt_set_task(e, bpf_get_current_pid_tgid());
	pt_submit(e);
	return 1;
}

SEC("cgroup/connect4")
int pt_connect4(struct bpf_sock_addr *ctx)
{
	if (ctx->user_family != AF_INET)
		return 1;
	return pt_sock_addr(ctx, PT_KIND_CONNECT, ctx->user_ip4);
}

/* A dual-stack socket connecting to ::ffff:a.b.c.d runs the connect6 hooks
 * only. (Its unconnected UDP sends do run sendmsg4.) */
SEC("cgroup/connect6")
int pt_connect6(struct bpf_sock_addr *ctx)
{
	__u32 addr[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
	if (ctx->user_family != AF_INET6 || !pt_v4mapped(addr))
		return 1;
	return pt_sock_addr(ctx, PT_KIND_CONNECT6, addr[3]);
}

SEC("cgroup/sendmsg4")
int pt_sendmsg4(struct bpf_sock_addr *ctx)
{
	if (ctx->user_family != AF_INET)
		return 1;
	return pt_sock_addr(ctx, PT_KIND_SENDMSG, ctx->user_ip4);
}

/* pt_socket_source sets t's source to the socket's own local address and
 * port (the packet's address when the socket has none bound: an unconnected
 * UDP socket). */
static __always_inline void pt_socket_source(struct __sk_buff *skb, struct pt_tuple *t)
{
	__u32 port = skb->local_port; /* host byte order */
	__u32 addr = skb->local_ip4;
	if (!port || (t->proto != IPPROTO_TCP && t->proto != IPPROTO_UDP))
		return;
	t->sport = bpf_htons((__u16)port);
	if (addr)
		t->saddr = addr;
}

/* The netns of the socket that sends skb (0: none). */
static __always_inline __u32 pt_skb_netns(struct __sk_buff *skb)
{
	struct sk_buff *k = bpf_cast_to_kern_ctx(skb);
	struct sock *sk = k->sk;
	return sk ? sk->__sk_common.skc_net.net->ns.inum : 0;
}

/* The first packet a watched socket sends: its 4-tuple as it leaves the
 * socket layer; and an unconnected UDP socket's datagram that a socket LB
 * after sendmsg4 sent to a destination new for the socket (kind
 * PT_KIND_SENDMSG). cgroup_skb data starts at the IP header. */
SEC("cgroup_skb/egress")
int pt_sock_egress(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	/* The first packet can leave from softirq context (a retransmit): the
	 * netns comes from the connect/sendmsg that watched the socket. */
	__u32 netns;
	if (!pt_claim_cookie(cookie, &netns))
		return 1;

	struct pt_tuple t;
	if (pt_load_ipv4(skb, 0, &t) < 0)
		return 1;
	__u8 kind = 0;
	struct pt_dst *sent = NULL;
	if (netns == PT_NETNS_SENT_AGAIN) {
		/* Reported once per destination the socket's datagrams left
		 * for (its first packet's once more, as sendmsg4 saw another):
		 * a socket LB's new choice, which the later points then
		 * follow. */
		if (t.proto != IPPROTO_UDP || pt_sent_before(cookie, t.daddr, t.dport))
			return 1;
		netns = pt_skb_netns(skb);
		kind = PT_KIND_SENDMSG;
		sent = bpf_map_lookup_elem(&sent_again, &cookie);
	}
	bool learn = pt_learns_from(netns);
	if (learn && kind == PT_KIND_SENDMSG)
		pt_learn_endpoint(t.daddr, t.dport, t.proto);
	/* The packet's source is what it leaves with, which a node socket's
	 * packet gets after POSTROUTING: its masquerade (kube-proxy's
	 * MASQUERADE --random-fully of a hostNetwork client to a ClusterIP)
	 * gave it another port. Netfilter before NAT and conntrack's
	 * original tuple name the socket's own endpoint, which is the flow's
	 * client: report that; the port the SNAT chose stays learned for the
	 * uplink's frames. */
	if (learn)
		pt_learn_client(t.saddr, t.sport, t.proto);
	__u32 saddr = t.saddr;
	__u16 sport = t.sport;
	pt_socket_source(skb, &t);
	/* The source port is known from here on: later points follow the
	 * client endpoint whatever its destination becomes (learned above
	 * unless the packet's source is another). */
	if (learn && (t.saddr != saddr || t.sport != sport))
		pt_learn_client(t.saddr, t.sport, t.proto);
	struct pt_event *e = pt_reserve(PT_SOCKEGRESS);
	if (!e)
		return 1;
	pt_set_tuple(e, &t);
	e->kind = kind;
	if (sent) { /* what sendmsg4 saw it go to */
		e->req_daddr = sent->daddr;
		e->req_dport = sent->dport;
	}
	e->cookie = cookie;
	e->netns = netns;
	e->len = skb->len;
	pt_submit(e);
	return 1;
}

/* TCP_SYN_SENT is set in tcp_v4_connect before the source port is chosen, so
 * sport is 0 unless the socket was bound. A watched socket that closes from
 * SYN_SENT before its first packet reached the egress observer (the node's
 * filter at OUTPUT rejected or dropped its SYN) is reported again: its port
 * is known then, and nowhere else, and ties the socket to the flow the
 * netfilter observers saw. */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(pt_sock_state, const struct sock *sk, int oldstate, int newstate)
{
	/* Every TCP state change of the node comes here: the states first. */
	if (newstate != TCP_SYN_SENT && (newstate != TCP_CLOSE || oldstate != TCP_SYN_SENT))
		return 0;
	/* AF_INET6 too: a dual-stack socket to ::ffff:a.b.c.d uses skc_daddr. */
	__u16 family = sk->__sk_common.skc_family;
	if ((family != AF_INET && family != AF_INET6) || sk->sk_protocol != IPPROTO_TCP)
		return 0;
	__u32 daddr = sk->__sk_common.skc_daddr;
	__u64 cookie = 0;
	if (newstate == TCP_SYN_SENT) {
		if (!pt_watched_at(daddr, sk->__sk_common.skc_dport, IPPROTO_TCP))
			return 0;
	} else {
		cookie = bpf_get_socket_cookie((void *)sk);
		__u32 netns;
		if (!pt_claim_cookie(cookie, &netns))
			return 0;
	}

	struct pt_event *e = pt_reserve(PT_SOCKSTATE);
	if (!e)
		return 0;
	e->proto = IPPROTO_TCP;
	e->saddr = sk->__sk_common.skc_rcv_saddr;
	e->daddr = daddr;
	e->sport = bpf_htons(sk->__sk_common.skc_num);
	e->dport = sk->__sk_common.skc_dport;
	e->netns = sk->__sk_common.skc_net.net->ns.inum; /* the socket's, not the task's */
	if (cookie) {
		/* The tracepoint runs after the close gave the port back
		 * (skc_num is 0 by then); inet_sport still holds it. */
		struct tcp_sock *tp = bpf_skc_to_tcp_sock((void *)sk);
		if (tp)
			e->sport = tp->inet_conn.icsk_inet.inet_sport;
		/* The close may run in softirq (an RST): no task of the socket's. */
		e->cookie = cookie;
		e->kind = PT_KIND_CLOSED;
	} else {
		e->cookie = bpf_get_socket_cookie((void *)sk);
		pt_set_task(e, bpf_get_current_pid_tgid());
	}
	pt_submit(e);
	return 0;
}
