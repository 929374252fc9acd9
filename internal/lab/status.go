package lab

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// Status is what `pathtrace lab status` shows.
type Status struct {
	Name         string            `json:"name"`
	Complete     bool              `json:"complete"` // every namespace, the cgroup and the server exist
	Mode         Mode              `json:"mode,omitempty"`
	Namespaces   []NamespaceStatus `json:"namespaces"`
	Interfaces   []InterfaceStatus `json:"interfaces"`
	ClientCgroup string            `json:"clientCgroup,omitempty"` // "" when it does not exist
	Programs     []AttachedProgram `json:"programs"`
	// Netfilter modes: the kube-proxy table and the bridge's switch to the IPv4 hooks.
	KubeProxyRules       bool         `json:"kubeProxyRules"`
	BridgeNFCallIPTables string       `json:"bridgeNfCallIptables,omitempty"`
	Server               ServerStatus `json:"server"`
	Healthy              bool         `json:"healthy"`
	Health               string       `json:"health"`
}

// NamespaceStatus is one of the lab's network namespaces.
type NamespaceStatus struct {
	Role   string `json:"role"` // pod, node, gw, backend
	Path   string `json:"path"`
	Exists bool   `json:"exists"`
}

// InterfaceStatus is one interface in a lab namespace.
type InterfaceStatus struct {
	NetNS  string   `json:"netns"` // role
	Name   string   `json:"name"`
	Up     bool     `json:"up"`
	MAC    string   `json:"mac,omitempty"`
	Master string   `json:"master,omitempty"`
	Addrs  []string `json:"addrs,omitempty"`
}

// ServerStatus is the backend worker.
type ServerStatus struct {
	PID     int      `json:"pid,omitempty"`
	Running bool     `json:"running"`
	Listen  []string `json:"listen"`
}

// Status reports the lab's state; a lab that is down is not an error.
func (l *Lab) Status() (Status, error) {
	if err := l.checkName(); err != nil {
		return Status{}, err
	}
	st := Status{
		Name:     l.name,
		Complete: l.complete(),
		Mode:     l.currentMode(),
		Server:   ServerStatus{Listen: []string{"tcp " + TCPBackend.String(), "udp " + UDPBackend.String()}},
	}
	var errs []error
	for _, role := range roles() {
		ns := NamespaceStatus{Role: role, Path: l.netnsPath(role), Exists: isNetNS(l.netnsPath(role))}
		st.Namespaces = append(st.Namespaces, ns)
		if ns.Exists {
			ifaces, err := interfaces(role, ns.Path)
			errs = append(errs, err)
			st.Interfaces = append(st.Interfaces, ifaces...)
		}
	}
	if dir := l.ClientCgroup(); dir != "" {
		if _, err := os.Stat(dir); err == nil {
			st.ClientCgroup = dir
		}
	}
	for _, hook := range l.allHooks() {
		progs, err := labPrograms(hook)
		errs = append(errs, err)
		st.Programs = append(st.Programs, progs...)
	}
	legacy, err := l.legacyTCPrograms()
	errs = append(errs, err)
	st.Programs = append(st.Programs, legacy...)
	if isNetNS(l.NodeNetNS()) {
		var err error
		st.KubeProxyRules, err = hasKubeProxyRules(l.NodeNetNS())
		errs = append(errs, err)
		st.BridgeNFCallIPTables, err = readSysctl(l.NodeNetNS(), bridgeNFCallIPTables)
		errs = append(errs, err)
	}
	if pid, err := readPIDFile(l.serverPIDFile()); err == nil {
		st.Server.PID, st.Server.Running = pid, l.isOurWorker(pid, workerServer)
	}
	st.Healthy, st.Health = l.health(st)
	return st, errors.Join(errs...)
}

// interfaces lists the links of one lab namespace.
func interfaces(role, path string) ([]InterfaceStatus, error) {
	var out []InterfaceStatus
	err := nsutil.Netlink(path, func(h *netlink.Handle) error {
		links, err := h.LinkList()
		if err != nil {
			return err
		}
		names := map[int]string{}
		for _, link := range links {
			names[link.Attrs().Index] = link.Attrs().Name
		}
		for _, link := range links {
			a := link.Attrs()
			if a.Name == "lo" {
				continue
			}
			is := InterfaceStatus{NetNS: role, Name: a.Name, Up: a.Flags&net.FlagUp != 0,
				MAC: a.HardwareAddr.String(), Master: names[a.MasterIndex]}
			addrs, err := h.AddrList(link, netlink.FAMILY_V4)
			if err != nil {
				return err
			}
			for _, addr := range addrs {
				is.Addrs = append(is.Addrs, addr.IPNet.String())
			}
			out = append(out, is)
		}
		return nil
	})
	return out, err
}

// healthPort is the Pod-side source port of the health probe: outside the
// ephemeral range, so no translated flow of the client ever shares its tuple.
const healthPort = 31999

// health sends one datagram from the Pod straight to the backend's echo (not
// to the VIP, so it does not depend on the mode): it crosses the veth, the
// bridge, the VLAN uplink and the gateway.
func (l *Lab) health(st Status) (bool, string) {
	switch {
	case !st.Complete:
		return false, "lab is down or incomplete (run `" + l.Command("up") + "`)"
	case !st.Server.Running:
		return false, "backend server is not running"
	}
	start := time.Now()
	var reply string
	err := nsutil.Do(l.PodNetNS(), func() error {
		conn, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(PodIP, healthPort)))
		if err != nil {
			return err
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(time.Second))
		if _, err := conn.WriteToUDPAddrPort([]byte("pathtrace lab health"), UDPBackend); err != nil {
			return err
		}
		buf := make([]byte, 64)
		n, _, err := conn.ReadFromUDPAddrPort(buf)
		reply = string(buf[:n])
		return err
	})
	if err != nil || reply != "pathtrace lab health" {
		return false, fmt.Sprintf("pod %s cannot reach backend %s over the VLAN %d uplink: %v", PodIP, UDPBackend, VLAN, err)
	}
	return true, fmt.Sprintf("pod %s reaches backend %s over the VLAN %d uplink (%s)",
		PodIP, UDPBackend, VLAN, time.Since(start).Round(10*time.Microsecond))
}
