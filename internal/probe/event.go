package probe

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// Layout of struct pt_event (bpf/observe.h). Integers are little endian (the
// objects are built for bpfel), addresses and ports network order as in the
// packet. TestEventLayoutMatchesBTF checks these offsets against the object.
const (
	evKtime     = 0
	evCookie    = 8
	evCgroup    = 16
	evNetns     = 24
	evPid       = 28
	evIfindex   = 32
	evLen       = 36
	evSaddr     = 40
	evDaddr     = 44
	evReqDaddr  = 48
	evSport     = 52
	evDport     = 54
	evReqDport  = 56
	evVlanTCI   = 58
	evVlanProto = 60
	evPoint     = 62
	evDir       = 63
	evProto     = 64
	evHook      = 65
	evKind      = 66
	evTCPFlags  = 67
	evComm      = 68
	evCommLen   = 16
	evReason    = 84
	evLocation  = 88
	eventSize   = 96
)

// bpfPointCount is PT_POINTS, the size of the loss counter array.
const bpfPointCount = 9

// bpfPoints maps enum pt_point onto obs.Point.
var bpfPoints = map[uint32]obs.Point{
	1: obs.PointSockAddr,
	2: obs.PointSockState,
	3: obs.PointSockEgress,
	4: obs.PointTCHead,
	5: obs.PointTCTail,
	6: obs.PointNFBefore,
	7: obs.PointNFAfter,
	8: obs.PointDrop,
}

// decodeEvent turns one ring-buffer record into an observation. monoEpoch is
// the wall-clock time at which CLOCK_MONOTONIC was zero. Interface names and
// netfilter priorities are not in the record; the Probe adds them.
func decodeEvent(raw []byte, monoEpoch time.Time) (o obs.Observation, err error) {
	if len(raw) < eventSize {
		return obs.Observation{}, fmt.Errorf("event of %d bytes, want %d", len(raw), eventSize)
	}
	le := binary.LittleEndian
	point, ok := bpfPoints[uint32(raw[evPoint])]
	if !ok {
		return obs.Observation{}, fmt.Errorf("event with unknown point %d", raw[evPoint])
	}
	// Field by field into the result: a composite literal was built on
	// the stack and copied out with wide loads over its narrow stores (a
	// store-forwarding stall per event).
	o.Time = monoEpoch.Add(time.Duration(le.Uint64(raw[evKtime:])))
	o.Point = point
	o.Proto = obs.Proto(raw[evProto])
	o.Src = addrPort(raw[evSaddr:], raw[evSport:])
	o.Dst = addrPort(raw[evDaddr:], raw[evDport:])
	o.ReqDst = addrPort(raw[evReqDaddr:], raw[evReqDport:])
	o.Cookie = le.Uint64(raw[evCookie:])
	o.PID = le.Uint32(raw[evPid:])
	o.Cgroup = le.Uint64(raw[evCgroup:])
	o.Ifindex = int(le.Uint32(raw[evIfindex:]))
	o.NetNS = uint64(le.Uint32(raw[evNetns:]))
	o.Len = int(le.Uint32(raw[evLen:]))
	o.TCPFlags = raw[evTCPFlags]
	comm := raw[evComm : evComm+evCommLen]
	if i := bytes.IndexByte(comm, 0); i >= 0 {
		comm = comm[:i]
	}
	o.Comm = string(comm)
	switch raw[evDir] {
	case 1:
		o.Dir = obs.DirIn
	case 2:
		o.Dir = obs.DirOut
	}
	switch point {
	case obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
		o.Kind = obs.SockKind(raw[evKind])
	case obs.PointNFBefore, obs.PointNFAfter:
		o.Hook = obs.Hook(raw[evHook])
	case obs.PointDrop:
		// The names are the Probe's to add (name).
		o.Drop = &obs.KernelDrop{Code: le.Uint32(raw[evReason:]), Location: le.Uint64(raw[evLocation:])}
	}
	if tpid := le.Uint16(raw[evVlanProto:]); tpid != 0 {
		o.TPID = tpid
		o.VLAN = le.Uint16(raw[evVlanTCI:]) & 0x0fff
	}
	return o, nil
}

// addrPort reads a network-order IPv4 address and port; the zero AddrPort
// ("not known") when the address is 0.0.0.0.
func addrPort(addr, port []byte) netip.AddrPort {
	a := netip.AddrFrom4([4]byte(addr[:4]))
	if a.IsUnspecified() {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(a, binary.BigEndian.Uint16(port))
}
