package discover

import (
	"bufio"
	"encoding/hex"
	"io"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// readIPVS reports IPVS in the node netns: present or not, and the virtual
// services of the services with their real servers.
func readIPVS(hostPath string, svcs serviceSet) IPVS {
	var services []IPVSService
	err := nsutil.Do(hostPath, func() error {
		f, err := os.Open(ipvsFile)
		if err != nil {
			return err
		}
		defer f.Close()
		services = parseIPVS(f)
		return nil
	})
	switch {
	case os.IsNotExist(err):
		return IPVS{Note: "absent: no /proc/net/ip_vs in the node netns (ip_vs module not loaded)"}
	case err != nil:
		return IPVS{Note: "not checked: " + err.Error()}
	}
	return IPVS{Present: true, Services: ipvsServices(services, svcs)}
}

// parseIPVS parses /proc/net/ip_vs: service lines ("TCP  0A780050:0050 rr")
// each followed by its real servers ("  -> 0AF4141F:0BB8      Masq    1 0 0").
// Firewall-mark services have no address and are skipped.
func parseIPVS(r io.Reader) []IPVSService {
	var out []IPVSService
	cur := -1
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		if fields[0] == "->" {
			if ap, ok := parseIPVSAddrPort(fields[1]); ok && cur >= 0 {
				out[cur].Backends = append(out[cur].Backends, ap)
			}
			continue
		}
		switch fields[0] {
		case "TCP", "UDP", "SCTP":
		default:
			cur = -1 // header or FWM service
			continue
		}
		ap, ok := parseIPVSAddrPort(fields[1])
		if !ok {
			cur = -1
			continue
		}
		s := IPVSService{Proto: strings.ToLower(fields[0]), Service: ap}
		if len(fields) > 2 {
			s.Scheduler = fields[2]
		}
		out = append(out, s)
		cur = len(out) - 1
	}
	return out
}

// parseIPVSAddrPort reads "0A780050:0050" (IPv4 in hex) or "[2001:0db8:...]:0050".
func parseIPVSAddrPort(s string) (netip.AddrPort, bool) {
	i := strings.LastIndexByte(s, ':')
	if i < 0 {
		return netip.AddrPort{}, false
	}
	port, err := strconv.ParseUint(s[i+1:], 16, 16)
	if err != nil {
		return netip.AddrPort{}, false
	}
	host := s[:i]
	var addr netip.Addr
	if strings.HasPrefix(host, "[") {
		addr, err = netip.ParseAddr(strings.Trim(host, "[]"))
		if err != nil {
			return netip.AddrPort{}, false
		}
	} else {
		b, err := hex.DecodeString(host)
		if err != nil || len(b) != 4 {
			return netip.AddrPort{}, false
		}
		addr = netip.AddrFrom4([4]byte(b))
	}
	return netip.AddrPortFrom(addr, uint16(port)), true
}
