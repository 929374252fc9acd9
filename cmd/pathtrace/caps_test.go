package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMissingCaps: each capability a trace cannot do without is named when
// missing; CAP_BPF and CAP_PERFMON are not, while CAP_SYS_ADMIN stands in
// for them as the kernel lets it.
func TestMissingCaps(t *testing.T) {
	all := uint64(0)
	for _, c := range requiredCaps {
		all |= 1 << c.bit
	}
	if m := missingCaps(all); len(m) != 0 {
		t.Errorf("all capabilities: missing %q", m)
	}
	for _, c := range requiredCaps {
		m := missingCaps(all &^ (1 << c.bit))
		if c.orSysAdmin {
			if len(m) != 0 {
				t.Errorf("without %s but with CAP_SYS_ADMIN: missing %q, want none", c.name, m)
			}
			continue
		}
		if len(m) != 1 || !strings.HasPrefix(m[0], c.name+" (") {
			t.Errorf("without %s: missing %q, want it alone", c.name, m)
		}
	}
	m := missingCaps(all &^ (1<<unix.CAP_SYS_ADMIN | 1<<unix.CAP_BPF))
	if len(m) != 2 || !strings.HasPrefix(m[0], "CAP_BPF") || !strings.HasPrefix(m[1], "CAP_SYS_ADMIN") {
		t.Errorf("without CAP_SYS_ADMIN and CAP_BPF: missing %q, want both", m)
	}
	if got := capNames(missingCaps(0)); got != "BPF, PERFMON, NET_ADMIN, NET_RAW, SYS_ADMIN" {
		t.Errorf("capability names for a container's securityContext: %q", got)
	}
}

// TestMissingCapExitsOne: root whose bounding set lacks a capability pathtrace
// needs (a container's, not privileged) is refused with one line naming it
// and exit 1, before anything is attached.
func TestMissingCapExitsOne(t *testing.T) {
	needRoot(t)
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("no setpriv")
	}
	for _, drop := range []string{"net_admin", "net_raw", "sys_admin"} {
		var keep []string
		for _, c := range []string{"bpf", "perfmon", "net_admin", "net_raw", "sys_admin"} {
			if c != drop {
				keep = append(keep, "+"+c)
			}
		}
		caps := "-all," + strings.Join(keep, ",")
		cmd := exec.Command("setpriv", "--inh-caps=-all", "--bounding-set="+caps, "--", os.Args[0], "--svc", "10.120.0.80", "--duration", "1s", "--nice", "0")
		cmd.Env = append(os.Environ(), runMainEnv+"=1")
		out, err := cmd.CombinedOutput()
		ee, _ := err.(*exec.ExitError)
		want := "CAP_" + strings.ToUpper(drop)
		if ee == nil || ee.ExitCode() != exitRuntime || strings.Count(string(out), "\n") != 1 || !strings.Contains(string(out), "needs "+want) {
			t.Errorf("without %s: exit %v, output %q; want exit 1 and one line naming %s", want, err, out, want)
		}
	}
}
