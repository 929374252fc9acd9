// SPDX-License-Identifier: GPL-2.0
// The lab's Service load balancers, in the two shapes Cilium uses:
//   - socket LB: cgroup connect4/sendmsg4 rewrite the VIP to a backend before any
//     packet exists; recvmsg4/getpeername4 restore the VIP for the application
//     (cil_sock4_connect, cil_sock4_sendmsg, cil_sock4_recvmsg, cil_sock4_getpeername);
//   - tc LB: tcx on the host side of the Pod's veth, DNAT on ingress (from the
//     Pod) and reverse NAT on egress (to the Pod) (cil_from_container,
//     cil_to_container). Like Cilium, they end the tcx chain (TCX_PASS).
// The Service table is filled by the loader. The reverse-NAT maps remember which
// VIP a socket (or a client 4-tuple) was translated from, so only translated
// traffic is reversed.

#include "headers/vmlinux.h"
#include "headers/bpf_helpers.h"
#include "headers/bpf_endian.h"

#define ETH_HLEN 14
#define ETH_P_IP 0x0800
#define IP_MF 0x2000
#define IP_OFFSET 0x1fff

// Offsets in a frame with an IPv4 header without options (the lab sends none).
#define IP_CSUM_OFF (ETH_HLEN + 10)
#define SADDR_OFF (ETH_HLEN + 12)
#define DADDR_OFF (ETH_HLEN + 16)
#define L4_OFF (ETH_HLEN + 20)
#define SPORT_OFF (L4_OFF + 0)
#define DPORT_OFF (L4_OFF + 2)
#define TCP_CSUM_OFF (L4_OFF + 16)
#define UDP_CSUM_OFF (L4_OFF + 6)

// All addresses and ports are in network byte order.
struct lb4_key {
	__be32 address;
	__be16 dport;
	__u8 proto;
	__u8 pad;
};

struct lb4_addr {
	__be32 address;
	__be16 port;
	__u16 pad;
};

struct sock_revnat_key {
	__u64 cookie;
	__be32 address; // backend the socket talks to
	__be16 port;
	__u8 proto;
	__u8 pad;
};

struct tc_revnat_key {
	__be32 client;
	__be32 backend;
	__be16 client_port;
	__be16 backend_port;
	__u8 proto;
	__u8 pad[3];
};

// Service VIP:port/proto -> backend.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16);
	__type(key, struct lb4_key);
	__type(value, struct lb4_addr);
} lab_services SEC(".maps");

// (socket, backend) -> VIP, for recvmsg4 and getpeername4.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct sock_revnat_key);
	__type(value, struct lb4_addr);
} lab_sock_revnat SEC(".maps");

// (client, backend) 4-tuple -> VIP, for replies towards the Pod.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct tc_revnat_key);
	__type(value, struct lb4_addr);
} lab_tc_revnat SEC(".maps");

/* Socket LB. Every sock_addr program returns 1: it never refuses a call. */

static __always_inline void sock4_translate(struct bpf_sock_addr *ctx)
{
	struct lb4_key key = {
		.address = ctx->user_ip4,
		.dport = (__be16)ctx->user_port,
		.proto = (__u8)ctx->protocol,
	};
	struct lb4_addr *found = bpf_map_lookup_elem(&lab_services, &key);
	if (!found)
		return;
	struct lb4_addr backend = *found;
	struct sock_revnat_key rkey = {
		.cookie = bpf_get_socket_cookie(ctx),
		.address = backend.address,
		.port = backend.port,
		.proto = key.proto,
	};
	struct lb4_addr vip = { .address = key.address, .port = key.dport };
	bpf_map_update_elem(&lab_sock_revnat, &rkey, &vip, BPF_ANY);
	ctx->user_ip4 = backend.address;
	ctx->user_port = backend.port;
}

static __always_inline void sock4_reverse(struct bpf_sock_addr *ctx)
{
	struct sock_revnat_key rkey = {
		.cookie = bpf_get_socket_cookie(ctx),
		.address = ctx->user_ip4,
		.port = (__be16)ctx->user_port,
		.proto = (__u8)ctx->protocol,
	};
	struct lb4_addr *vip = bpf_map_lookup_elem(&lab_sock_revnat, &rkey);
	if (!vip)
		return;
	ctx->user_ip4 = vip->address;
	ctx->user_port = vip->port;
}

SEC("cgroup/connect4")
int lab_sock4_connect(struct bpf_sock_addr *ctx)
{
	sock4_translate(ctx);
	return 1;
}

SEC("cgroup/sendmsg4")
int lab_sock4_sendmsg(struct bpf_sock_addr *ctx)
{
	sock4_translate(ctx);
	return 1;
}

SEC("cgroup/recvmsg4")
int lab_sock4_recvmsg(struct bpf_sock_addr *ctx)
{
	sock4_reverse(ctx);
	return 1;
}

SEC("cgroup/getpeername4")
int lab_sock4_getpeer(struct bpf_sock_addr *ctx)
{
	sock4_reverse(ctx);
	return 1;
}

/* tc LB. */

struct l4ports {
	__be16 source;
	__be16 dest;
};

struct flow4 {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
};

// parse_flow4 reads an unfragmented IPv4 TCP/UDP packet's addresses and ports.
static __always_inline bool parse_flow4(struct __sk_buff *skb, struct flow4 *f)
{
	struct iphdr ip;
	struct l4ports ports;

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return false;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return false;
	if (ip.ihl != 5 || (ip.frag_off & bpf_htons(IP_MF | IP_OFFSET)))
		return false;
	if (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP)
		return false;
	if (bpf_skb_load_bytes(skb, L4_OFF, &ports, sizeof(ports)))
		return false;

	f->saddr = ip.saddr;
	f->daddr = ip.daddr;
	f->sport = ports.source;
	f->dport = ports.dest;
	f->proto = ip.protocol;
	return true;
}

// rewrite4 replaces one address and its port, fixing the IP checksum and the
// L4 checksum (the address is part of the pseudo-header). The helpers handle
// CHECKSUM_PARTIAL skbs from veths, where the L4 field holds only the
// pseudo-header sum, and UDP's "no checksum" zero.
static __always_inline int rewrite4(struct __sk_buff *skb, __u32 addr_off, __be32 old_addr,
				    __be32 new_addr, __u32 port_off, __be16 old_port,
				    __be16 new_port, __u8 proto)
{
	__u32 csum_off = proto == IPPROTO_TCP ? TCP_CSUM_OFF : UDP_CSUM_OFF;
	__u64 zero_ok = proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;

	if (bpf_l4_csum_replace(skb, csum_off, old_addr, new_addr,
				BPF_F_PSEUDO_HDR | zero_ok | sizeof(new_addr)))
		return -1;
	if (bpf_l4_csum_replace(skb, csum_off, old_port, new_port, zero_ok | sizeof(new_port)))
		return -1;
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old_addr, new_addr, sizeof(new_addr)))
		return -1;
	if (bpf_skb_store_bytes(skb, addr_off, &new_addr, sizeof(new_addr), 0))
		return -1;
	if (bpf_skb_store_bytes(skb, port_off, &new_port, sizeof(new_port), 0))
		return -1;
	return 0;
}

// From the Pod: DNAT VIP -> backend.
SEC("tc")
int lab_from_container(struct __sk_buff *skb)
{
	struct flow4 f;
	if (!parse_flow4(skb, &f))
		return TCX_PASS;

	struct lb4_key key = { .address = f.daddr, .dport = f.dport, .proto = f.proto };
	struct lb4_addr *found = bpf_map_lookup_elem(&lab_services, &key);
	if (!found)
		return TCX_PASS;
	struct lb4_addr backend = *found;

	struct tc_revnat_key ct = {
		.client = f.saddr,
		.backend = backend.address,
		.client_port = f.sport,
		.backend_port = backend.port,
		.proto = f.proto,
	};
	struct lb4_addr vip = { .address = f.daddr, .port = f.dport };
	bpf_map_update_elem(&lab_tc_revnat, &ct, &vip, BPF_ANY);

	// A half-rewritten packet must not leave.
	if (rewrite4(skb, DADDR_OFF, f.daddr, backend.address, DPORT_OFF, f.dport, backend.port,
		     f.proto))
		return TCX_DROP;
	return TCX_PASS;
}

// To the Pod: reverse NAT backend -> VIP for replies of translated flows.
SEC("tc")
int lab_to_container(struct __sk_buff *skb)
{
	struct flow4 f;
	if (!parse_flow4(skb, &f))
		return TCX_PASS;

	struct tc_revnat_key ct = {
		.client = f.daddr,
		.backend = f.saddr,
		.client_port = f.dport,
		.backend_port = f.sport,
		.proto = f.proto,
	};
	struct lb4_addr *found = bpf_map_lookup_elem(&lab_tc_revnat, &ct);
	if (!found)
		return TCX_PASS;
	struct lb4_addr vip = *found;

	if (rewrite4(skb, SADDR_OFF, f.saddr, vip.address, SPORT_OFF, f.sport, vip.port, f.proto))
		return TCX_DROP;
	return TCX_PASS;
}

char __license[] SEC("license") = "GPL";
