package lab

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// A small AF_PACKET tap for the tests: it reads the kernel's out-of-band VLAN
// tag and checksum state from PACKET_AUXDATA.

type frame struct {
	data      []byte
	outgoing  bool
	vlanValid bool
	vlanTCI   uint16
	csumReady bool // false: CHECKSUM_PARTIAL, the L4 field holds the pseudo-header sum
}

func (f frame) etherType() uint16 { return binary.BigEndian.Uint16(f.data[12:14]) }
func (f frame) dstMAC() net.HardwareAddr {
	return net.HardwareAddr(f.data[0:6])
}

// ipv4 returns the frame's IPv4 header and L4 segment, if it carries IPv4 with
// TCP or UDP.
func (f frame) ipv4() (ip, l4 []byte, ok bool) {
	if len(f.data) < 14+20 || f.etherType() != unix.ETH_P_IP {
		return nil, nil, false
	}
	ip = f.data[14:]
	ihl := int(ip[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(ip[2:4]))
	if ihl < 20 || total > len(ip) || (ip[9] != unix.IPPROTO_TCP && ip[9] != unix.IPPROTO_UDP) {
		return nil, nil, false
	}
	return ip[:ihl], ip[ihl:total], len(ip[ihl:total]) >= 8
}

func ipSrc(ip []byte) netip.Addr { return netip.AddrFrom4([4]byte(ip[12:16])) }
func ipDst(ip []byte) netip.Addr { return netip.AddrFrom4([4]byte(ip[16:20])) }
func l4Src(l4 []byte) uint16     { return binary.BigEndian.Uint16(l4[0:2]) }
func l4Dst(l4 []byte) uint16     { return binary.BigEndian.Uint16(l4[2:4]) }

type tap struct{ fd int }

// openTap captures every frame of iface in the netns at netnsPath.
func openTap(t *testing.T, netnsPath, iface string) *tap {
	t.Helper()
	proto := int(htons(unix.ETH_P_ALL))
	fd := -1
	err := nsutil.Do(netnsPath, func() error {
		ifi, err := net.InterfaceByName(iface)
		if err != nil {
			return err
		}
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto); err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_AUXDATA, 1); err != nil {
			return err
		}
		return unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200_000})
	})
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		t.Fatalf("tap on %s in %s: %v", iface, netnsPath, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return &tap{fd: fd}
}

// drain returns what was captured, once nothing arrived for 200ms.
func (tp *tap) drain(t *testing.T) []frame {
	t.Helper()
	var frames []frame
	buf := make([]byte, 65536)
	oob := make([]byte, 256)
	for {
		n, oobn, _, from, err := unix.Recvmsg(tp.fd, buf, oob, 0)
		if errors.Is(err, unix.EAGAIN) {
			return frames
		}
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			t.Fatalf("read tap: %v", err)
		}
		f := frame{data: append([]byte(nil), buf[:n]...), csumReady: true}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok {
			f.outgoing = ll.Pkttype == unix.PACKET_OUTGOING
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			t.Fatalf("parse auxdata: %v", err)
		}
		for _, m := range msgs {
			if m.Header.Level != unix.SOL_PACKET || m.Header.Type != unix.PACKET_AUXDATA ||
				len(m.Data) < int(unsafe.Sizeof(unix.TpacketAuxdata{})) {
				continue
			}
			aux := (*unix.TpacketAuxdata)(unsafe.Pointer(&m.Data[0]))
			f.vlanValid = aux.Status&unix.TP_STATUS_VLAN_VALID != 0
			f.vlanTCI = aux.Vlan_tci
			f.csumReady = aux.Status&unix.TP_STATUS_CSUMNOTREADY == 0
		}
		frames = append(frames, f)
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// onesSum is the Internet checksum's ones'-complement sum, folded to 16 bits.
func onesSum(sum uint32, b []byte) uint32 {
	for ; len(b) >= 2; b = b[2:] {
		sum += uint32(binary.BigEndian.Uint16(b))
	}
	if len(b) == 1 {
		sum += uint32(b[0]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return sum
}

// checkChecksums verifies a captured IPv4 TCP/UDP packet's checksums: the IP
// header's, and the L4 one: complete, or (CHECKSUM_PARTIAL) the pseudo-header
// sum the kernel leaves for the NIC to finish.
func checkChecksums(f frame, ip, l4 []byte) error {
	if onesSum(0, ip) != 0xffff {
		return errors.New("bad IPv4 header checksum")
	}
	proto := ip[9]
	csumOff := 6
	if proto == unix.IPPROTO_TCP {
		csumOff = 16
	}
	if len(l4) < csumOff+2 {
		return errors.New("short L4 header")
	}
	field := binary.BigEndian.Uint16(l4[csumOff:])
	if proto == unix.IPPROTO_UDP && field == 0 {
		return nil // no checksum
	}
	pseudo := make([]byte, 0, 12)
	pseudo = append(pseudo, ip[12:20]...)
	pseudo = append(pseudo, 0, proto)
	pseudo = binary.BigEndian.AppendUint16(pseudo, uint16(len(l4)))
	if !f.csumReady {
		if want := onesSum(0, pseudo); uint32(field) != want && !(field == 0 && want == 0xffff) {
			return fmt.Errorf("partial L4 checksum %#04x, want pseudo-header sum %#04x", field, want)
		}
		return nil
	}
	if onesSum(onesSum(0, pseudo), l4) != 0xffff {
		return fmt.Errorf("bad L4 checksum %#04x", field)
	}
	return nil
}

// disableTXChecksum turns off a device's TX checksum offload (ETHTOOL_STXCSUM),
// so its packets carry complete checksums instead of CHECKSUM_PARTIAL ones.
func disableTXChecksum(t *testing.T, netnsPath, iface string) {
	t.Helper()
	const ethtoolSTXCSUM = 0x17
	type ethtoolValue struct{ cmd, data uint32 }
	type ifreqData struct {
		name [unix.IFNAMSIZ]byte
		data unsafe.Pointer
		_    [24 - unsafe.Sizeof(uintptr(0))]byte
	}
	err := nsutil.Do(netnsPath, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		val := ethtoolValue{cmd: ethtoolSTXCSUM}
		req := ifreqData{data: unsafe.Pointer(&val)}
		copy(req.name[:], iface)
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(&req))); errno != 0 {
			return errno
		}
		return nil
	})
	if err != nil {
		t.Fatalf("disable TX checksum offload on %s: %v", iface, err)
	}
}
