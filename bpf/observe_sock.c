/* Socket bracket: what the application asked for (syscall arguments, read at
 * raw sys_enter) against what the socket uses (cgroup connect4/sendmsg4 run
 * after every socket-LB program that precedes this observer in the cgroup
 * order), then the socket's first packet and its TCP SYN_SENT state, which tie
 * the socket cookie to the packet 4-tuple. x86-64 syscall numbers. */
#include "observe.h"
#include "headers/bpf_tracing.h"

#define AF_INET 2
#define SYS_CONNECT 42
#define SYS_SENDTO 44
#define SYS_SENDMSG 46
/* A request older than this is stale (its syscall never reached a cgroup
 * hook, e.g. sendto on a connected TCP socket). */
#define REQUEST_MAX_AGE_NS 1000000000ULL

struct pt_request {
	__u64 ktime_ns;
	__u32 daddr;
	__u16 dport;
	__u8 kind; /* enum pt_kind */
	__u8 _pad;
};

/* What each thread last asked for, until its cgroup hook consumes it. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u64); /* pid_tgid */
	__type(value, struct pt_request);
} req_dst SEC(".maps");

/* Sockets that connected or sent to a watched address and whose first packet
 * has not been seen yet. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64); /* socket cookie */
	__type(value, __u8);
} watch_cookies SEC(".maps");

/* The first 8 bytes of a sockaddr_in: family, port, address. */
struct pt_sockaddr_in {
	__u16 family;
	__u16 port;
	__u32 addr;
};

SEC("raw_tracepoint/sys_enter")
int pt_sys_enter(struct bpf_raw_tracepoint_args *ctx)
{
	struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
	void *uaddr = NULL;
	__u8 kind;

	switch (ctx->args[1]) {
	case SYS_CONNECT: /* connect(fd, addr, len) */
		uaddr = (void *)BPF_CORE_READ(regs, si);
		kind = PT_KIND_CONNECT;
		break;
	case SYS_SENDTO: /* sendto(fd, buf, len, flags, addr, addrlen) */
		uaddr = (void *)BPF_CORE_READ(regs, r8);
		kind = PT_KIND_SENDMSG;
		break;
	case SYS_SENDMSG: { /* sendmsg(fd, msg, flags) */
		struct user_msghdr *msg = (void *)BPF_CORE_READ(regs, si);
		if (!msg || bpf_probe_read_user(&uaddr, sizeof(uaddr), &msg->msg_name))
			return 0;
		kind = PT_KIND_SENDMSG;
		break;
	}
	default:
		return 0;
	}
	if (!uaddr)
		return 0;

	struct pt_sockaddr_in sa;
	if (bpf_probe_read_user(&sa, sizeof(sa), uaddr) || sa.family != AF_INET ||
	    !pt_watched(sa.addr))
		return 0;

	__u64 id = bpf_get_current_pid_tgid();
	struct pt_request req = {
		.ktime_ns = bpf_ktime_get_ns(),
		.daddr = sa.addr,
		.dport = sa.port,
		.kind = kind,
	};
	bpf_map_update_elem(&req_dst, &id, &req, BPF_ANY);
	return 0;
}

static __always_inline __u32 pt_current_netns(void)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	return BPF_CORE_READ(task, nsproxy, net_ns, ns.inum);
}

static __always_inline void pt_set_task(struct pt_event *e, __u64 pid_tgid)
{
	e->pid = pid_tgid >> 32;
	e->cgroup_id = bpf_get_current_cgroup_id();
	e->netns = pt_current_netns();
	bpf_get_current_comm(e->comm, sizeof(e->comm));
}

static __always_inline int pt_sock_addr(struct bpf_sock_addr *ctx, __u8 kind)
{
	if (ctx->user_family != AF_INET)
		return 1;

	__u64 id = bpf_get_current_pid_tgid();
	__u32 req_daddr = 0;
	__u16 req_dport = 0;
	struct pt_request *req = bpf_map_lookup_elem(&req_dst, &id);
	if (req) {
		if (req->kind == kind && bpf_ktime_get_ns() - req->ktime_ns < REQUEST_MAX_AGE_NS) {
			req_daddr = req->daddr;
			req_dport = req->dport;
		}
		bpf_map_delete_elem(&req_dst, &id);
	}

	__u32 daddr = ctx->user_ip4;
	if (!pt_watched(daddr) && !pt_watched(req_daddr))
		return 1;

	__u64 cookie = bpf_get_socket_cookie(ctx);
	__u8 one = 1;
	bpf_map_update_elem(&watch_cookies, &cookie, &one, BPF_ANY);

	struct pt_event *e = pt_reserve(PT_SOCKADDR);
	if (!e)
		return 1;
	e->kind = kind;
	e->proto = ctx->protocol;
	e->daddr = daddr;
	e->dport = (__u16)ctx->user_port;
	e->req_daddr = req_daddr;
	e->req_dport = req_dport;
	e->cookie = cookie;
	pt_set_task(e, id);
	bpf_ringbuf_submit(e, 0);
	return 1;
}

SEC("cgroup/connect4")
int pt_connect4(struct bpf_sock_addr *ctx)
{
	return pt_sock_addr(ctx, PT_KIND_CONNECT);
}

SEC("cgroup/sendmsg4")
int pt_sendmsg4(struct bpf_sock_addr *ctx)
{
	return pt_sock_addr(ctx, PT_KIND_SENDMSG);
}

/* The first packet a watched socket sends: its 4-tuple as it leaves the
 * socket layer. cgroup_skb data starts at the IP header. */
SEC("cgroup_skb/egress")
int pt_sock_egress(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	if (!cookie || !bpf_map_lookup_elem(&watch_cookies, &cookie))
		return 1;
	bpf_map_delete_elem(&watch_cookies, &cookie);

	struct pt_tuple t;
	if (pt_load_ipv4(skb, 0, &t) < 0)
		return 1;
	struct pt_event *e = pt_reserve(PT_SOCKEGRESS);
	if (!e)
		return 1;
	pt_set_tuple(e, &t);
	e->cookie = cookie;
	e->len = skb->len;
	bpf_ringbuf_submit(e, 0);
	return 1;
}

/* TCP_SYN_SENT is set in tcp_v4_connect before the source port is chosen, so
 * sport is 0 unless the socket was bound. */
SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(pt_sock_state, const struct sock *sk, int oldstate, int newstate)
{
	if (newstate != TCP_SYN_SENT || sk->__sk_common.skc_family != AF_INET ||
	    sk->sk_protocol != IPPROTO_TCP)
		return 0;
	__u32 daddr = sk->__sk_common.skc_daddr;
	if (!pt_watched(daddr))
		return 0;

	struct pt_event *e = pt_reserve(PT_SOCKSTATE);
	if (!e)
		return 0;
	e->proto = IPPROTO_TCP;
	e->saddr = sk->__sk_common.skc_rcv_saddr;
	e->daddr = daddr;
	e->sport = bpf_htons(sk->__sk_common.skc_num);
	e->dport = sk->__sk_common.skc_dport;
	e->cookie = bpf_get_socket_cookie((void *)sk);
	pt_set_task(e, bpf_get_current_pid_tgid());
	e->netns = sk->__sk_common.skc_net.net->ns.inum; /* the socket's, not the task's */
	bpf_ringbuf_submit(e, 0);
	return 0;
}
