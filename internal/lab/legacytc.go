package lab

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// In tc-legacy mode the tc LB sits where older Cilium and Calico put theirs:
// cls_bpf filters (direct-action) under a clsact qdisc on the host veth.
// The kernel runs them after the whole tcx chain, so a tracer's tcx
// observers at the tail of the chain still see the VIP.

// legacyHooks are the clsact parents the lab's cls_bpf filters use.
var legacyHooks = []struct {
	parent uint32
	hook   string
}{
	{netlink.HANDLE_MIN_INGRESS, "ingress"},
	{netlink.HANDLE_MIN_EGRESS, "egress"},
}

// attachLegacyTCLB attaches the tc LB to the host veth as cls_bpf filters:
// DNAT on ingress, reverse NAT on egress. The filters keep the programs
// alive.
func (l *Lab) attachLegacyTCLB() error {
	objs, err := loadTCLB()
	if err != nil {
		return err
	}
	defer objs.close()
	progs := []*ebpf.Program{objs.FromContainer, objs.ToContainer}
	names := []string{labLBProgLabFromContainer, labLBProgLabToContainer}
	return nsutil.Netlink(l.NodeNetNS(), func(h *netlink.Handle) error {
		veth, err := h.LinkByName(HostVeth)
		if err != nil {
			return fmt.Errorf("interface %s: %w", HostVeth, err)
		}
		idx := veth.Attrs().Index
		if err := h.QdiscReplace(clsact(idx)); err != nil {
			return fmt.Errorf("add clsact to %s: %w", HostVeth, err)
		}
		for i, hk := range legacyHooks {
			f := &netlink.BpfFilter{
				FilterAttrs: netlink.FilterAttrs{LinkIndex: idx, Parent: hk.parent, Handle: 1,
					Protocol: unix.ETH_P_ALL, Priority: 1},
				Fd: progs[i].FD(), Name: names[i], DirectAction: true,
			}
			if err := h.FilterAdd(f); err != nil {
				return fmt.Errorf("add cls_bpf %s to %s %s: %w", names[i], HostVeth, hk.hook, err)
			}
		}
		return nil
	})
}

func clsact(ifindex int) *netlink.GenericQdisc {
	return &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}
}

// detachLegacyTCLB removes the host veth's clsact qdisc, and with it every
// cls_bpf filter on the device (the lab owns it). Missing is fine.
func (l *Lab) detachLegacyTCLB() error {
	if !isNetNS(l.NodeNetNS()) {
		return nil
	}
	err := nsutil.Netlink(l.NodeNetNS(), func(h *netlink.Handle) error {
		veth, err := h.LinkByName(HostVeth)
		if err != nil {
			return nil // no device, no qdisc
		}
		err = h.QdiscDel(clsact(veth.Attrs().Index))
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EINVAL) {
			return nil
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("remove clsact from %s: %w", HostVeth, err)
	}
	return nil
}

// legacyTCPrograms lists the lab's cls_bpf programs on the host veth.
func (l *Lab) legacyTCPrograms() ([]AttachedProgram, error) {
	if !isNetNS(l.NodeNetNS()) {
		return nil, nil
	}
	var progs []AttachedProgram
	err := nsutil.Netlink(l.NodeNetNS(), func(h *netlink.Handle) error {
		veth, err := h.LinkByName(HostVeth)
		if err != nil {
			return nil
		}
		for _, hk := range legacyHooks {
			filters, err := h.FilterList(veth, hk.parent)
			if err != nil {
				return fmt.Errorf("list %s %s filters: %w", HostVeth, hk.hook, err)
			}
			for _, f := range filters {
				bf, ok := f.(*netlink.BpfFilter)
				if !ok {
					continue
				}
				prog, err := ebpf.NewProgramFromID(ebpf.ProgramID(bf.Id))
				if err != nil {
					continue // removed meanwhile
				}
				info, err := prog.Info()
				prog.Close()
				if err != nil {
					return fmt.Errorf("info of program %d: %w", bf.Id, err)
				}
				if name := labProgramName(info.Name); name != "" {
					progs = append(progs, AttachedProgram{ID: ebpf.ProgramID(bf.Id), Name: name,
						Where: HostVeth + " cls_bpf " + hk.hook})
				}
			}
		}
		return nil
	})
	return progs, err
}
