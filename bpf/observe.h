/* Shared by pathtrace's kernel observers: the one event record every observer
 * emits, and the maps every observer family shares (user space creates them
 * once per session and hands the same maps to each family it loads).
 *
 * Observers only look: they never change a packet or an address, and they
 * always let the packet or the operation continue. The only thing they write
 * is pathtrace's own maps (events, and what they learn about flows). */
#ifndef PATHTRACE_OBSERVE_H
#define PATHTRACE_OBSERVE_H

#include "headers/vmlinux.h"
#include "headers/bpf_helpers.h"
#include "headers/bpf_endian.h"

char LICENSE[] SEC("license") = "GPL";

/* Where an event was seen. User space maps these onto obs.Point. */
enum pt_point {
	PT_SOCKADDR = 1,   /* cgroup connect4 / sendmsg4 */
	PT_SOCKSTATE = 2,  /* inet_sock_set_state -> TCP_SYN_SENT */
	PT_SOCKEGRESS = 3, /* cgroup_skb egress: first packet of a watched socket */
	PT_TC_HEAD = 4,
	PT_TC_TAIL = 5,
	PT_NF_BEFORE = 6, /* netfilter, just below the NAT priority */
	PT_NF_AFTER = 7,  /* netfilter, just above the NAT priority */
	PT_DROP = 8,      /* skb:kfree_skb: the kernel dropped the packet */
	PT_POINTS = 9,
};

enum pt_dir {
	PT_DIR_IN = 1,  /* tc ingress */
	PT_DIR_OUT = 2, /* tc egress */
};

enum pt_kind {
	PT_KIND_CONNECT = 1,
	PT_KIND_SENDMSG = 2,
	/* PT_SOCKSTATE: the socket closed in SYN_SENT before any packet of it
	 * passed the egress observer (a filter rule at OUTPUT rejected or
	 * dropped its SYN): the event carries its port, known only now. */
	PT_KIND_CLOSED = 3,
	/* PT_SOCKADDR: a dual-stack socket's connect to a v4-mapped address,
	 * for which the kernel ran the connect6 hooks (a socket LB's connect6
	 * program, not its connect4 one, rewrote it). */
	PT_KIND_CONNECT6 = 4,
};

/* One observation. Addresses and ports are in network byte order, VLAN fields
 * in host order. Fixed size; user space decodes it field by field. */
struct pt_event {
	__u64 ktime_ns; /* bpf_ktime_get_ns: CLOCK_MONOTONIC */
	__u64 cookie;   /* socket cookie (socket observers) */
	__u64 cgroup_id;
	__u32 netns; /* netns inode */
	__u32 pid;   /* tgid */
	__u32 ifindex;
	__u32 len; /* skb->len */
	__u32 saddr;
	__u32 daddr;
	__u32 req_daddr; /* what the application asked for (syscall arguments) */
	__u16 sport;
	__u16 dport;
	__u16 req_dport;
	__u16 vlan_tci;   /* out-of-band or first in-band tag */
	__u16 vlan_proto; /* TPID when tagged, else 0 */
	__u8 point;       /* enum pt_point */
	__u8 dir;         /* enum pt_dir */
	__u8 proto;       /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 hook;        /* netfilter hook (enum nf_inet_hooks) */
	__u8 kind;        /* enum pt_kind */
	__u8 tcp_flags;
	char comm[16];
	__u32 drop_reason; /* PT_DROP: enum skb_drop_reason */
	__u64 location;    /* PT_DROP: the kernel address that dropped it */
};

/* Never used: keeps struct pt_event in the object's BTF, where a test checks
 * the Go decoder's offsets against it. */
const struct pt_event *pt_event_layout __attribute__((unused));

/* Every event goes to one ring buffer, read by one reader per session. 512
 * KiB hold ~5000 events, five times what a 5000-new-flows-a-second client
 * makes between two polls (the per-flow budget bounds the rest); a ring
 * filling up wakes the reader early, and a reserve failure is counted per
 * point. The reader maps the data pages twice: 1 MiB of its RSS. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 512 << 10);
} events SEC(".maps");

/* Reserve failures per point (index enum pt_point): losses are reported,
 * never hidden. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PT_POINTS);
	__type(key, __u32);
	__type(value, __u64);
} ringbuf_losses SEC(".maps");

/* IPv4 addresses (network byte order) whose traffic is observed: the Service
 * VIPs and the backends learned so far. Filled from user space, and by the
 * observers with the backend a socket LB, a tc program or NAT chose, before
 * the first packet of that connection passes the later points. The value
 * says how: PT_WATCH_ANY_PORT, every port of the address (a VIP, a backend
 * known without its port); PT_WATCH_ENDPOINTS, only the endpoints of it in
 * watch_endpoints (a backend known with the port it serves), so the
 * address's other traffic (its other ports: a metrics scrape, another
 * Service's port, a flood) is left alone. A packet without ports (a later
 * fragment, ICMP) is matched by its address either way. */
#define PT_WATCH_ANY_PORT 1
#define PT_WATCH_ENDPOINTS 2

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
} watch_addrs SEC(".maps");

/* A backend endpoint: address and port in network byte order, protocol
 * (IPPROTO_TCP or IPPROTO_UDP; user space adds both when it does not know
 * which). Its address is in watch_addrs (PT_WATCH_ENDPOINTS, unless another
 * entry made it PT_WATCH_ANY_PORT), added after it. */
struct pt_endpoint {
	__be32 addr;
	__be16 port;
	__u8 proto;
	__u8 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 32768);
	__type(key, struct pt_endpoint);
	__type(value, __u8);
} watch_endpoints SEC(".maps");

/* A quick "maybe" in front of the watch maps: one bit per hash of each
 * learned client endpoint, and two side by side (one load) per hash of each
 * watched address: PT_MAYBE_ANY, the address is watched on every port (its
 * watch_addrs entry says so), and PT_MAYBE_ENDS, endpoints of it are in
 * watch_endpoints. A clear bit means "not so" without a hash-map lookup,
 * which is the answer for almost every packet of unrelated traffic; a set
 * bit means "look it up", and tells which map: a watched flow's packet finds
 * its endpoint in one lookup, not two. Each bit array has one writer: user
 * space sets the bits of the addresses it watches (whole value, one writer
 * at a time), the observers those they learn (atomic OR). A bit is set
 * before the map entries it stands for are added and never cleared, so a
 * clear bit is never wrong; an evicted client leaves a set bit, which only
 * costs a lookup. */
#define PT_ADDR_SLOTS (1 << 14)
#define PT_MAYBE_ANY 1
#define PT_MAYBE_ENDS 2
#define PT_CLIENT_BITS (1 << 16)

struct pt_user_bits {
	__u64 addrs[PT_ADDR_SLOTS * 2 / 64];
};

struct pt_kernel_bits {
	__u64 addrs[PT_ADDR_SLOTS * 2 / 64];
	__u64 clients[PT_CLIENT_BITS / 64];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pt_user_bits);
} watch_bits_user SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pt_kernel_bits);
} watch_bits_kernel SEC(".maps");

/* pt_mix is a 32-bit integer hash (lowbias32); user space has the same
 * (probe.mix32). */
static __always_inline __u32 pt_mix(__u32 x)
{
	x ^= x >> 16;
	x *= 0x7feb352d;
	x ^= x >> 15;
	x *= 0x846ca68b;
	x ^= x >> 16;
	return x;
}

static __always_inline __u32 pt_addr_slot(__u32 addr)
{
	return pt_mix(addr) & (PT_ADDR_SLOTS - 1);
}

static __always_inline __u32 pt_client_bit(__u32 addr, __u16 port, __u8 proto)
{
	return pt_mix(addr ^ pt_mix(((__u32)port << 8) | proto)) & (PT_CLIENT_BITS - 1);
}

static __always_inline bool pt_bit(const __u64 *words, __u32 bit)
{
	return words[bit / 64] & (1ULL << (bit % 64));
}

/* pt_set_bit sets a bit shared with other CPUs (the observers' arrays). */
static __always_inline void pt_set_bit(__u64 *words, __u32 bit)
{
	__sync_fetch_and_or(&words[bit / 64], 1ULL << (bit % 64));
}

/* pt_addr_maybe is addr's two bits (PT_MAYBE_ANY, PT_MAYBE_ENDS), of
 * both arrays; 0 for the null address. */
static __always_inline __u32 pt_addr_maybe(__u32 addr)
{
	if (!addr)
		return 0;
	__u32 key = 0, slot = pt_addr_slot(addr);
	struct pt_user_bits *u = bpf_map_lookup_elem(&watch_bits_user, &key);
	struct pt_kernel_bits *k = bpf_map_lookup_elem(&watch_bits_kernel, &key);
	/* Without the arrays (never the case), fall back to the lookups. */
	if (!u || !k)
		return PT_MAYBE_ANY | PT_MAYBE_ENDS;
	__u32 w = slot / 32, shift = slot % 32 * 2;
	return ((u->addrs[w] | k->addrs[w]) >> shift) & (PT_MAYBE_ANY | PT_MAYBE_ENDS);
}

static __always_inline void pt_set_kernel_addr_bit(__u32 addr, __u32 maybe)
{
	__u32 key = 0, slot = pt_addr_slot(addr);
	struct pt_kernel_bits *k = bpf_map_lookup_elem(&watch_bits_kernel, &key);
	if (k)
		__sync_fetch_and_or(&k->addrs[slot / 32], (__u64)maybe << (slot % 32 * 2));
}

static __always_inline __u8 pt_watched_how_maybe(__u32 addr, __u32 maybe)
{
	if (!maybe)
		return 0;
	__u8 *how = bpf_map_lookup_elem(&watch_addrs, &addr);
	return how ? *how : 0;
}

/* pt_watched_how is addr's watch_addrs value, 0 when it is not watched. */
static __always_inline __u8 pt_watched_how(__u32 addr)
{
	return pt_watched_how_maybe(addr, pt_addr_maybe(addr));
}

static __always_inline bool pt_has_ports(__u16 port, __u8 proto)
{
	return port && (proto == IPPROTO_TCP || proto == IPPROTO_UDP);
}

/* pt_watched_at tells whether the endpoint addr:port (proto) is watched:
 * every port of addr is, or that endpoint. A packet without ports (port 0:
 * a later fragment, ICMP, another protocol) is matched by its address. */
static __always_inline bool pt_watched_at(__u32 addr, __u16 port, __u8 proto)
{
	__u32 maybe = pt_addr_maybe(addr);
	if (!pt_has_ports(port, proto))
		return pt_watched_how_maybe(addr, maybe) != 0;
	/* The endpoint first: a watched flow's packet is done in one lookup.
	 * Without it, only an address watched on every port is. */
	if (maybe & PT_MAYBE_ENDS) {
		struct pt_endpoint k = {.addr = addr, .port = port, .proto = proto};
		if (bpf_map_lookup_elem(&watch_endpoints, &k))
			return true;
	}
	return (maybe & PT_MAYBE_ANY) && pt_watched_how_maybe(addr, maybe) == PT_WATCH_ANY_PORT;
}

/* The client side of a flow to a watched address, learned in the kernel by
 * the first observer that sees the flow (before any rewrite), so every later
 * point follows the flow after its destination changed and its replies, even
 * when the new destination was never named. */
struct pt_client {
	__be32 addr;
	__be16 port;
	__u8 proto;
	__u8 _pad;
};

/* Bounded: the least recently seen clients make room for new ones. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct pt_client);
	__type(value, __u8);
} watch_clients SEC(".maps");

/* In-kernel learning that failed (a map update refused, e.g. watch_addrs
 * full; a socket's watch taken by others before its first packet,
 * observe_sock.c's watch_cookies), index 0: counted, never hidden. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} learn_errors SEC(".maps");

static __always_inline void pt_count_learn_error(void)
{
	__u32 key = 0;
	__u64 *n = bpf_map_lookup_elem(&learn_errors, &key);
	if (n)
		(*n)++;
}

#define PT_EEXIST 17

/* pt_learn_endpoint watches addr:port (proto), the backend a socket LB, a
 * tc program or NAT chose: that endpoint only, or every port of addr when
 * the port is not known (no TCP or UDP port). The endpoint goes in before
 * its address, so an observer that finds the address finds the endpoint;
 * the address's entry is only added, never changed (one that watches every
 * port stays so). */
static __always_inline void pt_learn_endpoint(__u32 addr, __u16 port, __u8 proto)
{
	if (!addr || pt_watched_at(addr, port, proto))
		return;
	if (!pt_has_ports(port, proto)) {
		__u8 any = PT_WATCH_ANY_PORT;
		pt_set_kernel_addr_bit(addr, PT_MAYBE_ANY); /* before the entry: see watch_bits_user */
		if (bpf_map_update_elem(&watch_addrs, &addr, &any, BPF_ANY))
			pt_count_learn_error();
		return;
	}
	struct pt_endpoint k = {.addr = addr, .port = port, .proto = proto};
	__u8 one = 1, eps = PT_WATCH_ENDPOINTS;
	pt_set_kernel_addr_bit(addr, PT_MAYBE_ENDS);
	if (bpf_map_update_elem(&watch_endpoints, &k, &one, BPF_ANY)) {
		pt_count_learn_error();
		return;
	}
	long err = bpf_map_update_elem(&watch_addrs, &addr, &eps, BPF_NOEXIST);
	if (err && err != -PT_EEXIST)
		pt_count_learn_error();
}

/* Only TCP and UDP endpoints with a port are learned: a port-less key would
 * match every fragment and ICMP message of that address. */
static __always_inline bool pt_client_key(struct pt_client *k, __u32 addr, __u16 port, __u8 proto)
{
	if (!addr || !port || (proto != IPPROTO_TCP && proto != IPPROTO_UDP))
		return false;
	k->addr = addr;
	k->port = port;
	k->proto = proto;
	k->_pad = 0;
	return true;
}

/* pt_learn_client adds a client endpoint to watch_clients. Every packet of a
 * flow to a watched address comes here: a lookup (which also keeps the entry
 * recent in the LRU) is far cheaper than an update, which only the first one
 * needs. */
static __always_inline bool pt_client_maybe(__u32 addr, __u16 port, __u8 proto)
{
	__u32 key = 0;
	struct pt_kernel_bits *k = bpf_map_lookup_elem(&watch_bits_kernel, &key);
	return !k || pt_bit(k->clients, pt_client_bit(addr, port, proto));
}

static __always_inline void pt_learn_client(__u32 addr, __u16 port, __u8 proto)
{
	struct pt_client k;
	__u8 one = 1;
	if (!pt_client_key(&k, addr, port, proto))
		return;
	if (pt_client_maybe(addr, port, proto) && bpf_map_lookup_elem(&watch_clients, &k))
		return;
	__u32 key = 0;
	struct pt_kernel_bits *b = bpf_map_lookup_elem(&watch_bits_kernel, &key);
	if (b) /* before the entry: see watch_bits_user */
		pt_set_bit(b->clients, pt_client_bit(addr, port, proto));
	if (bpf_map_update_elem(&watch_clients, &k, &one, BPF_ANY))
		pt_count_learn_error();
}

static __always_inline bool pt_watched_client(__u32 addr, __u16 port, __u8 proto)
{
	struct pt_client k;
	return pt_client_key(&k, addr, port, proto) && pt_client_maybe(addr, port, proto) &&
	       bpf_map_lookup_elem(&watch_clients, &k);
}

/* pt_reserve_at returns a zeroed event stamped with now (bpf_ktime_get_ns)
 * and point, or NULL after counting the loss. A packet observer reads the
 * clock once per run and passes it to everything that needs it (its budget,
 * its note, its event): in a VM each read is a helper call of tens of ns. */
static __always_inline struct pt_event *pt_reserve_at(__u8 point, __u64 now)
{
	struct pt_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		__u32 key = point;
		__u64 *lost = bpf_map_lookup_elem(&ringbuf_losses, &key);
		if (lost)
			(*lost)++;
		return NULL;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->ktime_ns = now;
	e->point = point;
	return e;
}

/* pt_reserve is pt_reserve_at reading the clock itself: for an observer
 * that needs the time for its event only. */
static __always_inline struct pt_event *pt_reserve(__u8 point)
{
	return pt_reserve_at(point, bpf_ktime_get_ns());
}

/* Events are submitted without waking the reader, which polls the ring while
 * they come (every 100 ms, every 10 ms while many come): one wakeup per event
 * would cost more than the event. A reader whose last poll found nothing
 * sleeps until the next submit wakes it (reader_asleep). A ring filling up
 * between two polls wakes it at once: every submit past PT_WAKEUP_BYTES
 * does, until it has read the ring down again. (Waking only on crossing the
 * mark lost events under a burst of connections: tried.) */
#define PT_WAKEUP_BYTES (128 << 10)

/* reader_asleep (key 0) is 1 while the reader sleeps because its last poll
 * found nothing: instead of polling an idle ring, it waits for the next
 * submit, which wakes it and clears the flag. The reader sets the flag, then
 * looks at the ring once more; a submit reserves (moving the producer
 * position), then looks at the flag: with a full barrier between each
 * side's store and load, one of them sees the other's store, so an event
 * never waits for a reader that went to sleep past it. Mapped into the
 * reader's memory. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64); /* 64 bits: bpf2go's -mcpu=v1 has no 32-bit exchange */
} reader_asleep SEC(".maps");

/* submit_fence is a word per CPU for pt_submit's barrier: an exchange is a
 * fetching atomic, fully ordered, on a line no other CPU writes. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} submit_fence SEC(".maps");

/* pt_wake_sleeper reports whether the reader sleeps, and takes its flag (one
 * submit wakes it, not every one until it runs). */
static __always_inline bool pt_wake_sleeper(void)
{
	__u32 key = 0;
	__u64 *fence = bpf_map_lookup_elem(&submit_fence, &key);
	if (fence)
		__sync_lock_test_and_set(fence, 0);
	__u64 *asleep = bpf_map_lookup_elem(&reader_asleep, &key);
	return asleep && *asleep && __sync_lock_test_and_set(asleep, 0);
}

static __always_inline void pt_submit(struct pt_event *e)
{
	__u64 flags = BPF_RB_NO_WAKEUP;
	if (pt_wake_sleeper() || bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) > PT_WAKEUP_BYTES)
		flags = BPF_RB_FORCE_WAKEUP;
	bpf_ringbuf_submit(e, flags);
}

/* An IPv4 packet's addresses and, for TCP/UDP, ports (0 in a non-first
 * fragment). */
struct pt_tuple {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 tcp_flags;
};

#define ETH_P_IP 0x0800
#define ETH_P_8021Q 0x8100
#define ETH_P_8021AD 0x88A8

/* pt_parse_l4 fills t's ports and TCP flags from the first bytes of the L4
 * header (at least 14 of them for TCP, 8 for UDP). */
static __always_inline void pt_parse_l4(struct pt_tuple *t, const __u8 *l4, __u32 len)
{
	if ((t->proto == IPPROTO_TCP && len >= 14) || (t->proto == IPPROTO_UDP && len >= 8)) {
		t->sport = *(const __u16 *)&l4[0];
		t->dport = *(const __u16 *)&l4[2];
		if (t->proto == IPPROTO_TCP)
			t->tcp_flags = l4[13];
	}
}

static __always_inline void pt_parse_ip(struct pt_tuple *t, const struct iphdr *ip)
{
	t->saddr = ip->saddr;
	t->daddr = ip->daddr;
	t->proto = ip->protocol;
	t->sport = 0;
	t->dport = 0;
	t->tcp_flags = 0;
}

/* pt_load_ipv4 reads the IPv4 header at off in skb (and the L4 ports after it).
 * Returns 0 on success, -1 when the packet is not IPv4 or is too short. */
static __always_inline int pt_load_ipv4(struct __sk_buff *skb, __u32 off, struct pt_tuple *t)
{
	struct iphdr ip;
	if (bpf_skb_load_bytes(skb, off, &ip, sizeof(ip)) < 0 || ip.version != 4)
		return -1;
	pt_parse_ip(t, &ip);
	if (ip.frag_off & bpf_htons(0x1fff)) /* not the first fragment */
		return 0;
	off += ip.ihl * 4;
	__u8 l4[14];
	if (ip.protocol == IPPROTO_TCP && bpf_skb_load_bytes(skb, off, l4, 14) == 0)
		pt_parse_l4(t, l4, 14);
	else if (ip.protocol == IPPROTO_UDP && bpf_skb_load_bytes(skb, off, l4, 8) == 0)
		pt_parse_l4(t, l4, 8);
	return 0;
}

/* An untagged Ethernet frame's headers up to the TCP flags, when the IPv4
 * header has no options: what most packets carry, read with one helper
 * call into eth, ip and l4, which are contiguous (the leading pad aligns the
 * IP header). */
struct pt_frame_head {
	__u8 _pad[2];
	struct ethhdr eth;
	struct iphdr ip;
	__u8 l4[14];
};

#define PT_FRAME_HEAD_LEN (sizeof(struct ethhdr) + sizeof(struct iphdr) + 14)
_Static_assert(__builtin_offsetof(struct pt_frame_head, l4) == 2 + PT_FRAME_HEAD_LEN - 14,
	       "eth, ip and l4 of struct pt_frame_head must be contiguous");

/* pt_skip_vlans finds the IPv4 header of an Ethernet frame whose EtherType
 * (after the MAC addresses) is proto: it skips up to two in-band 802.1Q /
 * 802.1ad tags from *off (just after that EtherType), leaving *off at the
 * IPv4 header. It reports the first in-band tag in *tci / *tpid (unchanged
 * when none). Returns 0 for IPv4, -1 otherwise (another EtherType, three
 * tags, or a frame cut in a tag). */
static __always_inline int pt_skip_vlans(struct __sk_buff *skb, __u16 proto, __u32 *off, __u16 *tci, __u16 *tpid)
{
	for (int i = 0; i < 2; i++) {
		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		struct vlan_hdr vh;
		if (bpf_skb_load_bytes(skb, *off, &vh, sizeof(vh)) < 0)
			return -1;
		if (i == 0) {
			*tci = bpf_ntohs(vh.h_vlan_TCI);
			*tpid = bpf_ntohs(proto);
		}
		proto = vh.h_vlan_encapsulated_proto;
		*off += sizeof(vh);
	}
	return proto == bpf_htons(ETH_P_IP) ? 0 : -1;
}

/* pt_load_frame reads an Ethernet frame's IPv4 tuple: in one read when the
 * frame is untagged and its IP header has no options (nor is a later
 * fragment), else header by header, skipping up to two in-band VLAN tags
 * (after the kernel moved the outer one out of band, if it did). It reports
 * the first in-band tag in *tci / *tpid (0 when none). Returns 0 for an IPv4
 * packet, -1 otherwise. */
static __always_inline int pt_load_frame(struct __sk_buff *skb, struct pt_tuple *t, __u16 *tci, __u16 *tpid)
{
	struct pt_frame_head h;
	*tci = *tpid = 0;
	long full = bpf_skb_load_bytes(skb, 0, &h.eth, PT_FRAME_HEAD_LEN);
	if (full < 0 && bpf_skb_load_bytes(skb, 0, &h.eth, sizeof(h.eth)) < 0)
		return -1;
	if (full == 0 && h.eth.h_proto == bpf_htons(ETH_P_IP) && h.ip.version == 4 && h.ip.ihl == 5 &&
	    !(h.ip.frag_off & bpf_htons(0x1fff))) {
		pt_parse_ip(t, &h.ip);
		pt_parse_l4(t, h.l4, sizeof(h.l4));
		return 0;
	}
	__u32 off = sizeof(h.eth);
	if (pt_skip_vlans(skb, h.eth.h_proto, &off, tci, tpid) < 0)
		return -1;
	return pt_load_ipv4(skb, off, t);
}

/* pt_interesting_but_dst is pt_interesting without the destination address,
 * for an observer that already looked that one up. */
static __always_inline bool pt_interesting_but_dst(const struct pt_tuple *t)
{
	return pt_watched_at(t->saddr, t->sport, t->proto) || pt_watched_client(t->saddr, t->sport, t->proto) ||
	       pt_watched_client(t->daddr, t->dport, t->proto);
}

/* pt_interesting is every packet observer's test: a watched endpoint (or
 * address watched on every port) on either side, or a learned client
 * endpoint on either side (the flow after its destination was rewritten to
 * an address never named, and its replies). */
static __always_inline bool pt_interesting(const struct pt_tuple *t)
{
	return pt_watched_at(t->daddr, t->dport, t->proto) || pt_interesting_but_dst(t);
}

/* pt_coarse_ms is now in units of 2^20 ns (~1.05 ms), as 32 bits that wrap
 * every ~52 days: ages are differences. */
static __always_inline __u32 pt_coarse_ms(__u64 now)
{
	return now >> 20;
}

/* pt_age is how long before now (pt_coarse_ms) then was. A stamp a little
 * after now is no age: another CPU's, taken while this run went on. Any
 * other difference is one, wrapped or not (a slot left alone for weeks). */
static __always_inline __u32 pt_age(__u32 now, __u32 then)
{
	__u32 d = now - then;
	return d > (__u32)-64 ? 0 : d;
}

/* Tables of 4-way sets: what the observers keep per flow-point (event
 * budgets, below) or per socket (observe_sock.c's watched sockets), where
 * a hash map's insert would cost most of a connection's observer time. A
 * key has one set (one cache line), where it finds its slot or takes a
 * free one, else the one stamped earliest. The tables are small on
 * purpose: the kernel allocates a map of at most 32 KiB with kmalloc, in
 * the direct mapping its huge pages cover, and a larger one with vmalloc,
 * in 4 KiB pages; here, in a VM, a connection's cold lookup in a 1 or 2 MiB
 * vmalloc'ed array took ~1 us of TLB and cache misses per observer. */
struct pt_slot {
	__u64 key;   /* 0: free */
	__u32 stamp; /* pt_coarse_ms (wraps) */
	__u32 val;
};

#define PT_WAYS 4

struct pt_set {
	struct pt_slot way[PT_WAYS];
};

_Static_assert(sizeof(struct pt_set) == 64, "a set is one cache line");

/* Per table: 500 sets of 64 bytes and the array map's own header (312
 * bytes on 6.18) stay under the 32 KiB the kernel allocates with kmalloc. A
 * kernel whose header is larger by more than 456 bytes vmallocs them:
 * slower, no less right. Four tables: 8000 slots. */
#define PT_SETS 500

/* PT_SET_TABLES declares the four array maps name_0 .. name_3 of PT_SETS
 * sets. */
#define PT_SET_TABLE                                    \
	struct {                                        \
		__uint(type, BPF_MAP_TYPE_ARRAY);       \
		__uint(max_entries, PT_SETS);           \
		__type(key, __u32);                     \
		__type(value, struct pt_set);           \
	}
#define PT_SET_TABLES(name)                             \
	PT_SET_TABLE name##_0 SEC(".maps");             \
	PT_SET_TABLE name##_1 SEC(".maps");             \
	PT_SET_TABLE name##_2 SEC(".maps");             \
	PT_SET_TABLE name##_3 SEC(".maps")

/* PT_SET_OF is the set of the tables name_0 .. name_3 of a key whose hash
 * is h (32 bits): the table from its low bits, the set from the rest. Each
 * map has its own lookup: the verifier wants to know the map. */
#define PT_SET_OF(name, h)                                                              \
	({                                                                              \
		__u32 _i = ((h) >> 2) % PT_SETS;                                        \
		struct pt_set *_s;                                                      \
		switch ((h) & 3) {                                                      \
		case 0:                                                                 \
			_s = bpf_map_lookup_elem(&name##_0, &_i);                       \
			break;                                                          \
		case 1:                                                                 \
			_s = bpf_map_lookup_elem(&name##_1, &_i);                       \
			break;                                                          \
		case 2:                                                                 \
			_s = bpf_map_lookup_elem(&name##_2, &_i);                       \
			break;                                                          \
		default:                                                                \
			_s = bpf_map_lookup_elem(&name##_3, &_i);                       \
		}                                                                       \
		_s;                                                                     \
	})

/* pt_set_find is key's slot in set, or NULL with *victim the slot a new
 * key takes: a free one, else the one stamped earliest (now: pt_coarse_ms). */
static __always_inline struct pt_slot *pt_set_find(struct pt_set *set, __u64 key, __u32 now, struct pt_slot **victim)
{
	struct pt_slot *oldest = &set->way[0];
#pragma unroll
	for (int i = 0; i < PT_WAYS; i++) {
		struct pt_slot *w = &set->way[i];
		if (w->key == key)
			return w;
		if (oldest->key && (!w->key || pt_age(now, w->stamp) > pt_age(now, oldest->stamp)))
			oldest = w;
	}
	*victim = oldest;
	return NULL;
}

/* Packet observers (tc, netfilter) report the first PT_EVENTS_PER_FLOW packets
 * of each flow direction at each point, then one every PT_REFILL_UNITS, and every
 * TCP SYN, FIN and RST: a verdict needs a flow's first packets, and a busy
 * flow must not flood the ring buffer (the packet taps still see every
 * packet). The budget refills with time because a 5-tuple outlives its flow:
 * a UDP client port used again by the next socket (a resolver's query after
 * query), or reused hours later, is another flow, whose first packets a
 * spent budget would leave out, and the engine would take the point's
 * silence for "not seen here" (a netfilter rewrite read as one after
 * netfilter). 10 ms: a client port bound again by socket after socket
 * (a query every few tens of ms) still finds tokens, and a bulk flow costs 100
 * events a second per point and direction. What is left out is counted per
 * point in events_summarized: summarized, not lost. */
#define PT_EVENTS_PER_FLOW 8
#define PT_REFILL_UNITS 10 /* pt_coarse_ms units: ~10.5 ms */

struct pt_flow_point {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 point;
	__u8 where; /* tc direction or netfilter hook */
	__u8 _pad;
} __attribute__((aligned(8))); /* hashed as two 64-bit words */

_Static_assert(sizeof(struct pt_flow_point) == 16, "pt_flow_point_hash reads two words");

/* The events a flow direction may still report at a point, and when the
 * budget last grew, in tables of 4-way sets (pt_set). A slot holds a 64-bit
 * hash of the flow-point, not the flow-point: twice the slots in the same
 * memory, and two live flow-points of one set sharing a hash (odds ~2^-62)
 * would only share a budget. A flow whose slot another took starts a new
 * budget when it comes back, as one an LRU map evicted did: a few more
 * events, never fewer. Updated without atomics: two CPUs racing may report
 * one event more or less, or start a budget again, which is all a budget
 * needs. */
PT_SET_TABLES(flow_events); /* key: pt_flow_point_hash; stamp: when the budget last grew; val: its tokens */

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PT_POINTS);
	__type(key, __u32);
	__type(value, __u64);
} events_summarized SEC(".maps");

/* pt_count_summarized counts a packet at point that was not reported. */
static __always_inline void pt_count_summarized(__u8 point)
{
	__u32 key = point;
	__u64 *summarized = bpf_map_lookup_elem(&events_summarized, &key);
	if (summarized)
		(*summarized)++;
}

/* pt_flow_point_hash is a 64-bit hash of k, never 0 (a free slot). */
static __always_inline __u64 pt_flow_point_hash(const struct pt_flow_point *k)
{
	const __u64 *w = (const __u64 *)k;
	__u32 lo = pt_mix(w[0] ^ pt_mix(w[0] >> 32) ^ pt_mix(w[1] ^ pt_mix(w[1] >> 32)));
	__u32 hi = pt_mix((w[0] >> 32) ^ pt_mix(w[1] ^ 0x9e3779b9) ^ pt_mix(w[0] ^ pt_mix((w[1] >> 32) ^ 0x7f4a7c15)));
	__u64 h = ((__u64)hi << 32) | lo;
	return h ? h : 1;
}

/* pt_take_budget takes one event of the budget of t's flow direction at
 * point (and where), counting one summarized when none is left. */
static __always_inline bool pt_take_budget(const struct pt_tuple *t, __u8 point, __u8 where, __u64 now)
{
	struct pt_flow_point k = {
		.saddr = t->saddr, .daddr = t->daddr, .sport = t->sport, .dport = t->dport,
		.proto = t->proto, .point = point, .where = where,
	};
	__u64 h = pt_flow_point_hash(&k);
	struct pt_set *set = PT_SET_OF(flow_events, (__u32)h);
	if (!set)
		return true;
	__u32 now_u = pt_coarse_ms(now);
	struct pt_slot *victim, *b = pt_set_find(set, h, now_u, &victim);
	if (!b) { /* a new budget */
		victim->key = h;
		victim->stamp = now_u;
		victim->val = PT_EVENTS_PER_FLOW - 1;
		return true;
	}
	__u32 elapsed = pt_age(now_u, b->stamp);
	if (elapsed >= PT_REFILL_UNITS) {
		__u32 more = elapsed / PT_REFILL_UNITS;
		__u32 tokens = b->val + (more < PT_EVENTS_PER_FLOW ? more : PT_EVENTS_PER_FLOW);
		b->val = tokens < PT_EVENTS_PER_FLOW ? tokens : PT_EVENTS_PER_FLOW;
		b->stamp = now_u;
	}
	if (b->val) {
		b->val--;
		return true;
	}
	pt_count_summarized(point);
	return false;
}

/* pt_within_budget is the packet observers' budget: every TCP SYN, FIN and
 * RST is reported, the other packets within their flow direction's budget. */
static __always_inline bool pt_within_budget(const struct pt_tuple *t, __u8 point, __u8 where, __u64 now)
{
	if (t->proto == IPPROTO_TCP && (t->tcp_flags & 0x07)) /* FIN, SYN, RST */
		return true;
	return pt_take_budget(t, point, where, now);
}

/* pt_quiet, per CPU and per point and direction (tc) or hook (netfilter):
 * the last flow direction a packet observer found over its budget there,
 * and the jiffy it was. The packets of that flow that follow within the
 * jiffy (1-10 ms; a watched bulk flow's next segments, mostly) are
 * summarized at once, without the lookups an over-budget packet costs
 * (its watch, its client learned again, its note for the next observers,
 * its budget): their flow's watch and client were looked at a moment ago
 * for its previous packet, and their budget cannot grow within a jiffy by
 * more than the token the next jiffy's first packet takes. Any other
 * watched packet that reaches the budget there on this CPU empties the
 * slot, so a flow whose budget another one evicted meanwhile starts a new
 * budget as before (unless the other ran on another CPU within that jiffy:
 * one event less, as two CPUs racing on a slot may make); SYN, FIN and RST
 * never take this way. */
struct pt_quiet {
	__u64 jiffies;
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u32 proto;
	__u64 _pad; /* 32 bytes: a slot never straddles two cache lines */
};

#define PT_QUIET_WHERE 5 /* tc directions 1-2, netfilter hooks 0-4 */

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PT_POINTS * PT_QUIET_WHERE);
	__type(key, __u32);
	__type(value, struct pt_quiet);
} quiet SEC(".maps");

static __always_inline struct pt_quiet *pt_quiet_slot(__u8 point, __u8 where)
{
	__u32 key = (__u32)point * PT_QUIET_WHERE + where;
	if (where >= PT_QUIET_WHERE)
		return NULL;
	return bpf_map_lookup_elem(&quiet, &key);
}

/* pt_quiet_packet tells whether t is a packet of the flow direction found
 * over its budget at point and where in this jiffy (then counted
 * summarized), and sets *slot to that place's slot for pt_budget_quiet.
 * Any other packet pays a per-CPU load and a comparison, and the clock is
 * read only for a packet of that flow. */
static __always_inline bool pt_quiet_packet(const struct pt_tuple *t, __u8 point, __u8 where, struct pt_quiet **slot)
{
	/* A SYN, FIN or RST is always reported and takes no budget (it evicts
	 * no flow's): it leaves the slot alone, which a connection's first
	 * packets then never load. */
	*slot = NULL;
	if (t->proto == IPPROTO_TCP && (t->tcp_flags & 0x07))
		return false;
	struct pt_quiet *q = pt_quiet_slot(point, where);
	*slot = q;
	if (!q || q->saddr != t->saddr || q->daddr != t->daddr || q->sport != t->sport || q->dport != t->dport ||
	    q->proto != t->proto || !q->jiffies || q->jiffies != bpf_jiffies64())
		return false;
	pt_count_summarized(point);
	return true;
}

/* pt_budget_quiet is pt_within_budget keeping the slot q (NULL: none) of
 * pt_quiet: the flow direction found over its budget now, or none. */
static __always_inline bool pt_budget_quiet(struct pt_quiet *q, const struct pt_tuple *t, __u8 point, __u8 where,
					    __u64 now)
{
	if (pt_within_budget(t, point, where, now)) {
		if (q && q->jiffies) /* written only when it held a flow */
			q->jiffies = 0;
		return true;
	}
	if (!q)
		return false;
	q->jiffies = bpf_jiffies64();
	q->saddr = t->saddr;
	q->daddr = t->daddr;
	q->sport = t->sport;
	q->dport = t->dport;
	q->proto = t->proto;
	return false;
}

/* The last packet to a watched address an observer saw on this CPU, before
 * the places that may rewrite it: the packet's own sk_buff (its address,
 * compared only), when, its client endpoint and the address it went to. A
 * later observer of the same packet on its way through the node (tc tail,
 * then netfilter before and after NAT: one softirq, one CPU, microseconds)
 * that sees it go elsewhere learns the new destination in the kernel
 * (pt_learn_rewrite), as the socket observers learn a socket LB's: the taps
 * then capture the flow's first packets beyond the rewrite, also where the
 * node's SNAT gives them a source no observer learned. Without it a backend
 * only a tc program chose was watched from user space's next look on, after
 * a short connection's packets had gone by. A freed sk_buff's address comes
 * back for later packets: the note is dropped where the packet's walk past
 * the observers ends, and is good for PT_REWRITE_WINDOW_NS only. That walk
 * usually takes microseconds, but the first packets after the observers
 * are attached took 100 us to 1 ms in one run of four here (cold programs
 * and maps): 2 ms keeps them, and a stale note still needs the same
 * sk_buff address and client endpoint to mislead. */
struct pt_to_watched {
	__u64 skb;
	__u64 at;
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u8 proto;
	__u8 _pad[5];
};

#define PT_REWRITE_WINDOW_NS 2000000

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pt_to_watched);
} last_to_watched SEC(".maps");

/* pt_note_to_watched records a packet (skb: its sk_buff's address) whose
 * destination is watched, seen at now. */
static __always_inline void pt_note_to_watched(__u64 skb, const struct pt_tuple *t, __u64 now)
{
	__u32 key = 0;
	struct pt_to_watched *w = bpf_map_lookup_elem(&last_to_watched, &key);
	if (!w)
		return;
	w->skb = skb;
	w->at = now;
	w->saddr = t->saddr;
	w->daddr = t->daddr;
	w->sport = t->sport;
	w->proto = t->proto;
}

/* pt_forget_to_watched drops the note of the packet skb (0: of whichever
 * packet): its walk past the observers is over. */
static __always_inline void pt_forget_to_watched(__u64 skb)
{
	__u32 key = 0;
	struct pt_to_watched *w = bpf_map_lookup_elem(&last_to_watched, &key);
	if (w && (!skb || w->skb == skb))
		w->skb = 0;
}

/* pt_learn_rewrite learns the destination endpoint of a packet an earlier
 * observer noted going to a watched address, from the same client
 * endpoint, which now goes (seen at now) to an address (or port of it) not
 * watched: the backend a rewrite between the two chose. */
static __always_inline void pt_learn_rewrite(__u64 skb, const struct pt_tuple *t, __u64 now)
{
	__u32 key = 0;
	struct pt_to_watched *w = bpf_map_lookup_elem(&last_to_watched, &key);
	if (!w || !skb || w->skb != skb || w->daddr == t->daddr || w->saddr != t->saddr || w->sport != t->sport ||
	    w->proto != t->proto)
		return;
	w->skb = 0; /* once */
	if (now - w->at <= PT_REWRITE_WINDOW_NS)
		pt_learn_endpoint(t->daddr, t->dport, t->proto);
}

static __always_inline void pt_set_tuple(struct pt_event *e, const struct pt_tuple *t)
{
	e->saddr = t->saddr;
	e->daddr = t->daddr;
	e->sport = t->sport;
	e->dport = t->dport;
	e->proto = t->proto;
	e->tcp_flags = t->tcp_flags;
}

#endif
