package probe

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// moduleTree is a fake module tree: loaded modules (a /sys/module directory
// and a /proc/modules line each; procModules false: a kernel without module
// support) and modules.builtin listing builtin.
func moduleTree(t *testing.T, procModules bool, loaded, builtin []string) kmod.Host {
	t.Helper()
	root := t.TempDir()
	h := kmod.Host{
		SysModule:       filepath.Join(root, "sys/module"),
		ProcModules:     filepath.Join(root, "proc/modules"),
		ModulesDisabled: filepath.Join(root, "proc/sys/kernel/modules_disabled"),
		LibModules:      filepath.Join(root, "lib/modules"),
		Release:         "6.18.0-test",
	}
	var proc, lib strings.Builder
	for _, m := range loaded {
		if err := os.MkdirAll(filepath.Join(h.SysModule, m), 0o755); err != nil {
			t.Fatal(err)
		}
		proc.WriteString(m + " 16384 0 - Live 0x0000000000000000\n")
	}
	for _, m := range builtin {
		lib.WriteString("kernel/net/netfilter/" + m + ".ko\n")
	}
	files := map[string]string{filepath.Join(h.LibModules, h.Release, "modules.builtin"): lib.String()}
	if procModules {
		files[h.ProcModules] = proc.String()
	}
	for path, text := range files {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// TestConntrackNeedsLoadedModules: the conntrack subscription is made only
// when nfnetlink, nf_conntrack and nf_conntrack_netlink are loaded or built
// in (or the kernel cannot load modules); otherwise subscribing would load
// them, and AttachConntrack reports the point as not attached, saying why,
// without opening a socket.
func TestConntrackNeedsLoadedModules(t *testing.T) {
	for _, tc := range []struct {
		name            string
		proc            bool
		loaded, builtin []string
		missing         string // "" = subscribe
	}{
		{"all loaded", true, []string{"nfnetlink", "nf_conntrack", "nf_conntrack_netlink"}, nil, ""},
		{"netlink part built in", true, []string{"nf_conntrack"}, []string{"nfnetlink", "nf_conntrack_netlink"}, ""},
		{"no module support", false, nil, nil, ""},
		{"nf_conntrack_netlink not loaded", true, []string{"nfnetlink", "nf_conntrack", "nf_nat"}, []string{"nf_tables"}, "nf_conntrack_netlink"},
		{"no connection tracking", true, []string{"nfnetlink"}, nil, "nf_conntrack"},
		{"nothing of netfilter", true, []string{"ext4"}, nil, "nfnetlink"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := moduleTree(t, tc.proc, tc.loaded, tc.builtin)
			err := conntrackModulesErr(h)
			if tc.missing == "" {
				if err != nil {
					t.Errorf("conntrackModulesErr: %v, want nil: every module is there", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.missing+" is not loaded") || !strings.Contains(err.Error(), "would load it") {
				t.Fatalf("conntrackModulesErr: %v, want it to say %s is not loaded and would be", err, tc.missing)
			}
			p := &Probe{modules: h} // no maps, no programs: only the check may run
			atts := p.AttachConntrack("")
			if len(atts) != 1 || atts[0].Err == nil || atts[0].Err.Error() != err.Error() || atts[0].Point != obs.PointConntrack {
				t.Errorf("AttachConntrack: %+v, want the conntrack point not attached: %v", atts, err)
			}
			if len(p.ctSubs) != 0 {
				t.Errorf("%d subscriptions made", len(p.ctSubs))
			}
		})
	}
}
