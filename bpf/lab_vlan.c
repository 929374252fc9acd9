// SPDX-License-Identifier: GPL-2.0
// The lab's uplink: a veth that carries 802.1Q VLAN traffic, emulated with BPF
// because the machine has no 802.1Q module. Attached with tcx on both ends of the
// uplink veth pair (node bond0 and the gateway's port): egress pushes the tag,
// ingress pops it. The tag travels out of band (skb->vlan_tci), as on real NICs.
// A veth receiver drops a frame that still carries a tag after tc ingress (it is
// marked OTHERHOST), so the pop on ingress is what makes the link work.

#include "headers/vmlinux.h"
#include "headers/bpf_helpers.h"
#include "headers/bpf_endian.h"

#define ETH_P_8021Q 0x8100
#define VLAN_VID_MASK 0x0fff

// Set by the loader: the VLAN ID of the uplink.
volatile const __u16 vlan_id = 0;

// Both return TCX_NEXT: the tag is the link's own behaviour, every other
// program on the device still runs.
SEC("tc")
int lab_vlan_push(struct __sk_buff *skb)
{
	if (!skb->vlan_present)
		bpf_skb_vlan_push(skb, bpf_htons(ETH_P_8021Q), vlan_id);
	return TCX_NEXT;
}

SEC("tc")
int lab_vlan_pop(struct __sk_buff *skb)
{
	if (skb->vlan_present && (skb->vlan_tci & VLAN_VID_MASK) == vlan_id)
		bpf_skb_vlan_pop(skb);
	return TCX_NEXT;
}

char __license[] SEC("license") = "GPL";
