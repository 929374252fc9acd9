package lab

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// The lab attaches its programs with plain BPF_PROG_ATTACH (no bpf_link, no
// pin): the kernel keeps them as long as the device or cgroup exists, after the
// process that loaded them has exited, and frees them with it.

// attachPoint is one hook of one device or cgroup the lab uses.
type attachPoint struct {
	netns  string // for tcx: the netns of iface (ifindexes are per netns)
	iface  string
	cgroup string // for cgroup hooks: the cgroup directory
	attach ebpf.AttachType
	hook   string // short name of the hook, for status
}

func (p attachPoint) String() string {
	if p.cgroup != "" {
		return "cgroup " + p.hook
	}
	if p.attach == ebpf.AttachNetkitPeer || p.attach == ebpf.AttachNetkitPrimary {
		return p.iface + " " + p.hook
	}
	return p.iface + " tcx " + p.hook
}

func tcxIngress(netns, iface string) attachPoint {
	return attachPoint{netns: netns, iface: iface, attach: ebpf.AttachTCXIngress, hook: "ingress"}
}

func tcxEgress(netns, iface string) attachPoint {
	return attachPoint{netns: netns, iface: iface, attach: ebpf.AttachTCXEgress, hook: "egress"}
}

func (l *Lab) cgroupHooks(dir string) []attachPoint {
	return []attachPoint{
		{cgroup: dir, attach: ebpf.AttachCGroupInet4Connect, hook: "connect4"},
		{cgroup: dir, attach: ebpf.AttachCGroupUDP4Sendmsg, hook: "sendmsg4"},
		{cgroup: dir, attach: ebpf.AttachCGroupUDP4Recvmsg, hook: "recvmsg4"},
		{cgroup: dir, attach: ebpf.AttachCgroupInet4GetPeername, hook: "getpeername4"},
	}
}

// modeHooks are where the mode-specific load balancers attach.
func (l *Lab) modeHooks() []attachPoint {
	hooks := []attachPoint{tcxIngress(l.NodeNetNS(), HostVeth), tcxEgress(l.NodeNetNS(), HostVeth)}
	if dir := l.ClientCgroup(); dir != "" {
		hooks = append(hooks, l.cgroupHooks(dir)...)
	}
	return hooks
}

// allHooks are every hook the lab may have programs on.
func (l *Lab) allHooks() []attachPoint {
	return append(l.modeHooks(),
		tcxIngress(l.NodeNetNS(), Uplink), tcxEgress(l.NodeNetNS(), Uplink),
		tcxIngress(l.GatewayNetNS(), GatewayPort), tcxEgress(l.GatewayNetNS(), GatewayPort))
}

// withTarget runs fn with the attach target of p: a cgroup fd, or an ifindex
// resolved (and used) inside the device's netns.
func withTarget(p attachPoint, fn func(target int) error) error {
	if p.cgroup != "" {
		dir, err := os.Open(p.cgroup)
		if err != nil {
			return fmt.Errorf("open cgroup: %w", err)
		}
		defer dir.Close()
		return fn(int(dir.Fd()))
	}
	return nsutil.Do(p.netns, func() error {
		ifi, err := net.InterfaceByName(p.iface)
		if err != nil {
			return fmt.Errorf("interface %s: %w", p.iface, err)
		}
		return fn(ifi.Index)
	})
}

func attachProgram(p attachPoint, prog *ebpf.Program) error {
	err := withTarget(p, func(target int) error {
		opts := link.RawAttachProgramOptions{Target: target, Program: prog, Attach: p.attach}
		if p.cgroup != "" {
			opts.Flags = unix.BPF_F_ALLOW_MULTI // coexist with observers and other LBs
		}
		return link.RawAttachProgram(opts)
	})
	if err != nil {
		return fmt.Errorf("attach to %s: %w", p, err)
	}
	return nil
}

// AttachedProgram is one lab BPF program attached in the kernel.
type AttachedProgram struct {
	ID    ebpf.ProgramID `json:"id"`
	Name  string         `json:"name"`
	Where string         `json:"where"` // e.g. "veth-a tcx ingress", "cgroup connect4"
}

// labProgramNames are the full names of every lab program.
func labProgramNames() []string {
	return []string{
		labVLANProgLabVlanPush, labVLANProgLabVlanPop,
		labLBProgLabSock4Connect, labLBProgLabSock4Sendmsg, labLBProgLabSock4Recvmsg,
		labLBProgLabSock4Getpeer, labLBProgLabFromContainer, labLBProgLabToContainer,
	}
}

// kernelNameMax is how many characters of a program name the kernel keeps.
const kernelNameMax = 15

// labProgramName maps a kernel program name (cut to 15 characters) to the
// lab program it belongs to, or "" for programs that are not the lab's.
func labProgramName(kernelName string) string {
	if kernelName == "" {
		return ""
	}
	for _, full := range labProgramNames() {
		if kernelName == full || (len(kernelName) == kernelNameMax && strings.HasPrefix(full, kernelName)) {
			return full
		}
	}
	return ""
}

// labPrograms lists the lab's programs attached at p. A missing device or
// cgroup has none.
func labPrograms(p attachPoint) ([]AttachedProgram, error) {
	var ids []ebpf.ProgramID
	err := withTarget(p, func(target int) error {
		res, err := link.QueryPrograms(link.QueryOptions{Target: target, Attach: p.attach})
		if err != nil {
			return err
		}
		for _, ap := range res.Programs {
			ids = append(ids, ap.ID)
		}
		return nil
	})
	if err != nil {
		if gone(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("query %s: %w", p, err)
	}
	var progs []AttachedProgram
	for _, id := range ids {
		prog, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // detached meanwhile
		}
		info, err := prog.Info()
		prog.Close()
		if err != nil {
			return nil, fmt.Errorf("info of program %d: %w", id, err)
		}
		if name := labProgramName(info.Name); name != "" {
			progs = append(progs, AttachedProgram{ID: id, Name: name, Where: p.String()})
		}
	}
	return progs, nil
}

// gone tells whether err means the netns, device or cgroup does not exist.
func gone(err error) bool {
	return errors.Is(err, os.ErrNotExist) || strings.Contains(err.Error(), "no such network interface")
}

// detachLabPrograms removes the lab's programs from p, leaving others alone.
func detachLabPrograms(p attachPoint) error {
	progs, err := labPrograms(p)
	if err != nil {
		return err
	}
	for _, ap := range progs {
		prog, err := ebpf.NewProgramFromID(ap.ID)
		if err != nil {
			continue
		}
		err = withTarget(p, func(target int) error {
			return link.RawDetachProgram(link.RawDetachProgramOptions{Target: target, Program: prog, Attach: p.attach})
		})
		prog.Close()
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("detach %s from %s: %w", ap.Name, p, err)
		}
	}
	return nil
}

// attachUplinkVLAN makes the node's uplink and the gateway's port a VLAN trunk:
// egress pushes the tag, ingress pops it, on both ends.
func (l *Lab) attachUplinkVLAN() error {
	spec, err := loadLabVLAN()
	if err != nil {
		return fmt.Errorf("load VLAN programs: %w", err)
	}
	if err := spec.Variables[labVLANVarVlanId].Set(uint16(VLAN)); err != nil {
		return fmt.Errorf("set VLAN ID: %w", err)
	}
	var objs labVLANObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return fmt.Errorf("load VLAN programs: %w", err)
	}
	defer objs.Close() // the attachments keep the programs alive
	for _, end := range []struct{ netns, iface string }{
		{l.NodeNetNS(), Uplink}, {l.GatewayNetNS(), GatewayPort},
	} {
		if err := attachProgram(tcxEgress(end.netns, end.iface), objs.LabVlanPush); err != nil {
			return err
		}
		if err := attachProgram(tcxIngress(end.netns, end.iface), objs.LabVlanPop); err != nil {
			return err
		}
	}
	return nil
}

type sockLBObjects struct {
	Connect  *ebpf.Program `ebpf:"lab_sock4_connect"`
	Sendmsg  *ebpf.Program `ebpf:"lab_sock4_sendmsg"`
	Recvmsg  *ebpf.Program `ebpf:"lab_sock4_recvmsg"`
	Getpeer  *ebpf.Program `ebpf:"lab_sock4_getpeer"`
	Services *ebpf.Map     `ebpf:"lab_services"`
}

// attachSocketLB attaches the socket LB to the client cgroup.
func (l *Lab) attachSocketLB() error {
	var objs sockLBObjects
	if err := loadLB(&objs); err != nil {
		return err
	}
	defer closeAll(objs.Connect, objs.Sendmsg, objs.Recvmsg, objs.Getpeer, objs.Services)
	if err := fillServices(objs.Services); err != nil {
		return err
	}
	hooks := l.cgroupHooks(l.ClientCgroup())
	for i, prog := range []*ebpf.Program{objs.Connect, objs.Sendmsg, objs.Recvmsg, objs.Getpeer} {
		if err := attachProgram(hooks[i], prog); err != nil {
			return err
		}
	}
	return nil
}

type tcLBObjects struct {
	FromContainer *ebpf.Program `ebpf:"lab_from_container"`
	ToContainer   *ebpf.Program `ebpf:"lab_to_container"`
	Services      *ebpf.Map     `ebpf:"lab_services"`
}

// loadTCLB loads the tc LB with the lab's Services in its map. Close it
// once attached: the attachments keep the programs alive.
func loadTCLB() (*tcLBObjects, error) {
	var objs tcLBObjects
	if err := loadLB(&objs); err != nil {
		return nil, err
	}
	if err := fillServices(objs.Services); err != nil {
		objs.close()
		return nil, err
	}
	return &objs, nil
}

func (o *tcLBObjects) close() { closeAll(o.FromContainer, o.ToContainer, o.Services) }

// attachTCLB attaches the tc LB to the host veth: DNAT on ingress, reverse on egress.
func (l *Lab) attachTCLB() error { return l.AttachTCLBTo(HostVeth) }

// AttachTCLBTo attaches a copy of the tc LB of mode tc (programs of their
// own, as Cilium loads one per endpoint) to hostVeth, a veth in the node
// netns, e.g. the host side of a Pod added to the lab's bridge. It stays
// until the veth is deleted (or, for the lab's own, until the mode changes).
func (l *Lab) AttachTCLBTo(hostVeth string) error {
	objs, err := loadTCLB()
	if err != nil {
		return err
	}
	defer objs.close()
	if err := attachProgram(tcxIngress(l.NodeNetNS(), hostVeth), objs.FromContainer); err != nil {
		return err
	}
	return attachProgram(tcxEgress(l.NodeNetNS(), hostVeth), objs.ToContainer)
}

// AttachNetkitLBTo attaches a copy of the tc LB to primary, the node side
// of a Pod's netkit pair in the netns at netnsPath, as Cilium's netkit
// datapath does: DNAT on what the Pod sends (the peer's programs), reverse
// NAT on what the node sends to it (the primary's). Like the veth's, it
// stays until the device is deleted. The programs read an Ethernet header,
// which a netkit's frames carry in L3 mode too.
func AttachNetkitLBTo(netnsPath, primary string) error {
	objs, err := loadTCLB()
	if err != nil {
		return err
	}
	defer objs.close()
	peer := attachPoint{netns: netnsPath, iface: primary, attach: ebpf.AttachNetkitPeer, hook: "netkit peer"}
	if err := attachProgram(peer, objs.FromContainer); err != nil {
		return err
	}
	return attachProgram(attachPoint{netns: netnsPath, iface: primary, attach: ebpf.AttachNetkitPrimary, hook: "netkit primary"}, objs.ToContainer)
}

func loadLB(objs any) error {
	spec, err := loadLabLB()
	if err != nil {
		return fmt.Errorf("load LB programs: %w", err)
	}
	if err := spec.LoadAndAssign(objs, nil); err != nil {
		return fmt.Errorf("load LB programs: %w", err)
	}
	return nil
}

func closeAll(closers ...interface{ Close() error }) {
	for _, c := range closers {
		c.Close()
	}
}

// fillServices writes the lab's two Services into an LB's service map.
func fillServices(m *ebpf.Map) error {
	for _, svc := range []struct {
		vip, backend netip.AddrPort
		proto        uint8
	}{
		{TCPVIP, TCPBackend, unix.IPPROTO_TCP},
		{UDPVIP, UDPBackend, unix.IPPROTO_UDP},
	} {
		key := labLBLb4Key{Address: be32(svc.vip.Addr()), Dport: be16(svc.vip.Port()), Proto: svc.proto}
		val := labLBLb4Addr{Address: be32(svc.backend.Addr()), Port: be16(svc.backend.Port())}
		if err := m.Put(&key, &val); err != nil {
			return fmt.Errorf("add service %s: %w", svc.vip, err)
		}
	}
	return nil
}

// be32 is an IPv4 address as the u32 whose memory holds it in network order.
func be32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.NativeEndian.Uint32(b[:])
}

// be16 is a port as the u16 whose memory holds it in network order.
func be16(port uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], port)
	return binary.NativeEndian.Uint16(b[:])
}
