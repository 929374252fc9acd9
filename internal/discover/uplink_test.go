package discover

import (
	"slices"
	"strings"
	"testing"
)

func TestChooseBridgeUplink(t *testing.T) {
	const gw = "02:00:00:00:00:01"
	// Port 5 is the pod's veth, 6 another pod's, 7 a veth towards the
	// network (as in kind and the lab), 8 a physical NIC.
	pod := bridgePort{index: 5, name: "vethpod", kind: "veth", podPeer: true}
	other := bridgePort{index: 6, name: "vethother", kind: "veth", podPeer: true}
	vethUp := bridgePort{index: 7, name: "up0", kind: "veth"}
	nic := bridgePort{index: 8, name: "eno1", kind: "device"}
	for _, tc := range []struct {
		name    string
		ports   []bridgePort
		fdb     []fdbEntry
		gwMAC   string
		want    []int
		howWord string
	}{
		{"gateway MAC learned on a veth beats a NIC", []bridgePort{pod, other, vethUp, nic},
			[]fdbEntry{{5, "02:00:00:00:00:99"}, {7, gw}}, gw, []int{7}, "FDB"},
		{"gateway MAC on the pod's own port is ignored", []bridgePort{pod, vethUp},
			[]fdbEntry{{5, gw}}, gw, []int{7}, "not pod veths"},
		{"no FDB entry: non-veth ports", []bridgePort{pod, other, vethUp, nic}, nil, gw, []int{8}, "not veths"},
		{"no gateway MAC: ports that are not pod veths", []bridgePort{pod, other, vethUp}, []fdbEntry{{7, gw}}, "", []int{7}, "not pod veths"},
		{"only pod veths", []bridgePort{pod, other}, nil, gw, nil, "no port"},
	} {
		got, how := chooseBridgeUplink("br0", tc.ports, tc.fdb, tc.gwMAC, 5)
		if !slices.Equal(got, tc.want) || !strings.Contains(how, tc.howWord) {
			t.Errorf("%s: got %v %q, want %v and a reason with %q", tc.name, got, how, tc.want, tc.howWord)
		}
	}
}
