package capture

import (
	"net/netip"
	"testing"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// ipv4Frame is an Ethernet frame (tagged with VLAN 200 when tagged) with an
// IPv4 header of protocol 17, identification 0x1234 and the given flags and
// fragment offset word, from 10.0.0.1 to 10.0.0.2, and 8 bytes after it.
func ipv4Frame(tagged bool, flagsOffset uint16) []byte {
	f := []byte{2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1}
	if tagged {
		f = append(f, 0x81, 0x00, 0x00, 200)
	}
	f = append(f, 0x08, 0x00,
		0x45, 0, 0, 28, 0x12, 0x34, byte(flagsOffset>>8), byte(flagsOffset), 64, 17, 0, 0,
		10, 0, 0, 1, 10, 0, 0, 2,
		0x9c, 0x40, 0, 53, 0, 8, 0, 0)
	return f
}

func TestFragment(t *testing.T) {
	for _, tc := range []struct {
		name        string
		tagged      bool
		flagsOffset uint16
		frag, first bool
	}{
		{"unfragmented", false, 0, false, false},
		{"don't fragment", false, 0x4000, false, false},
		{"first fragment", false, 0x2000, true, true},
		{"middle fragment", false, 0x2000 | 185, true, false},
		{"last fragment", false, 370, true, false},
		{"later fragment, in-band tag", true, 185, true, false},
	} {
		p := Packet{Data: ipv4Frame(tc.tagged, tc.flagsOffset)}
		if tup, _, tok := p.Tuple(); tok && tup.FirstFragment() != tc.first {
			t.Errorf("%s: Tuple says first fragment %v, want %v", tc.name, tup.FirstFragment(), tc.first)
		}
		k, first, ok := p.Fragment()
		if ok != tc.frag || first != tc.first {
			t.Errorf("%s: fragment %v first %v, want %v %v", tc.name, ok, first, tc.frag, tc.first)
			continue
		}
		if !ok {
			continue
		}
		src, dst := k.Addrs4()
		if src != netip.MustParseAddr("10.0.0.1") || dst != netip.MustParseAddr("10.0.0.2") || k.Proto() != obs.UDP || k.Rest>>32 != 0x1234 {
			t.Errorf("%s: key %v -> %v proto %v id %#x", tc.name, src, dst, k.Proto(), k.Rest>>32)
		}
		// A later fragment has no ports: Tuple must refuse it.
		if _, _, tok := p.Tuple(); tok != first {
			t.Errorf("%s: Tuple ok %v", tc.name, tok)
		}
	}
	// Two fragments of one datagram share the key; another ID does not.
	a, _, _ := (&Packet{Data: ipv4Frame(false, 0x2000)}).Fragment()
	b, _, _ := (&Packet{Data: ipv4Frame(true, 185)}).Fragment()
	if a != b {
		t.Errorf("fragments of one datagram: keys %v and %v", a, b)
	}
	f := ipv4Frame(false, 185)
	f[14+5]++
	if c, _, _ := (&Packet{Data: f}).Fragment(); c == a {
		t.Error("another IP ID, same key")
	}
}
