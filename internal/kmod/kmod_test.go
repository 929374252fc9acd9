package kmod

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeHost is a module tree: the directories of sys under /sys/module,
// the lines of proc as /proc/modules (nil: no module support), builtin as
// modules.builtin of release 6.1.0-test (nil: absent), disabled as
// modules_disabled ("" absent).
func fakeHost(t *testing.T, sys []string, proc, builtin []string, disabled string) Host {
	t.Helper()
	root := t.TempDir()
	h := Host{
		SysModule:       filepath.Join(root, "sys/module"),
		ProcModules:     filepath.Join(root, "proc/modules"),
		ModulesDisabled: filepath.Join(root, "proc/sys/kernel/modules_disabled"),
		LibModules:      filepath.Join(root, "lib/modules"),
		Release:         "6.1.0-test",
	}
	for _, d := range sys {
		if err := os.MkdirAll(filepath.Join(h.SysModule, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(path string, lines []string) {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		var b []byte
		for _, l := range lines {
			b = append(b, l+"\n"...)
		}
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if proc != nil {
		write(h.ProcModules, proc)
	}
	if builtin != nil {
		write(filepath.Join(h.LibModules, h.Release, "modules.builtin"), builtin)
	}
	if disabled != "" {
		write(h.ModulesDisabled, []string{disabled})
	}
	return h
}

func TestWouldLoad(t *testing.T) {
	loaded := []string{
		"nf_conntrack 196608 3 nf_nat,nft_ct,nf_conntrack_netlink, Live 0x0000000000000000",
		"nfnetlink 20480 4 nf_conntrack_netlink,nf_tables, Live 0x0000000000000000",
	}
	builtin := []string{"kernel/net/netfilter/nf_tables.ko", "kernel/net/netfilter/x_tables.ko", "kernel/drivers/net/dummy-thing.ko"}
	for _, tc := range []struct {
		name          string
		sys           []string
		proc, builtin []string
		disabled      string
		module        string
		want          bool
	}{
		{"loaded, in /sys/module", []string{"nf_conntrack_netlink"}, loaded, builtin, "", "nf_conntrack_netlink", false},
		{"loaded, in /proc/modules only", nil, loaded, builtin, "", "nfnetlink", false},
		{"built in, listed in modules.builtin", nil, loaded, builtin, "", "nf_tables", false},
		{"built in, a dash in its file name", nil, loaded, builtin, "", "dummy_thing", false},
		{"asked with a dash, loaded with an underscore", nil, loaded, builtin, "", "nf-conntrack", false},
		{"neither loaded nor built in", []string{"nf_conntrack"}, loaded, builtin, "", "nf_conntrack_netlink", true},
		{"a longer name that starts alike is not it", nil, []string{"nf_conntrack_netlink_x 1 0 - Live 0x0"}, []string{"kernel/net/netfilter/nf_conntrack_netlink_x.ko"}, "", "nf_conntrack_netlink", true},
		{"a module that names it as a user is not it", nil, loaded, builtin, "", "nf_nat", true},
		{"modules.builtin unreadable: cannot tell, so it would", nil, loaded, nil, "", "nf_tables", true},
		{"no module support: only built-ins exist", nil, nil, nil, "", "nf_conntrack_netlink", false},
		{"module loading switched off", nil, loaded, builtin, "1", "nf_conntrack_netlink", false},
		{"module loading still on", nil, loaded, builtin, "0", "nf_conntrack_netlink", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := fakeHost(t, tc.sys, tc.proc, tc.builtin, tc.disabled)
			if got := h.WouldLoad(tc.module); got != tc.want {
				t.Errorf("WouldLoad(%q) = %v, want %v", tc.module, got, tc.want)
			}
		})
	}
}

func TestFirstToLoad(t *testing.T) {
	h := fakeHost(t, []string{"nf_conntrack"}, []string{"nfnetlink 1 0 - Live 0x0"}, []string{}, "")
	if got := h.FirstToLoad("nfnetlink", "nf_conntrack", "nf_conntrack_netlink", "nf_tables"); got != "nf_conntrack_netlink" {
		t.Errorf("FirstToLoad = %q, want nf_conntrack_netlink", got)
	}
	if got := h.FirstToLoad("nfnetlink", "nf_conntrack"); got != "" {
		t.Errorf("FirstToLoad of loaded modules = %q, want none", got)
	}
}

// The running kernel: whatever it says, asking changes nothing, and a
// module that is there (its /sys/module directory) never would load.
func TestSystem(t *testing.T) {
	entries, err := os.ReadDir(System.SysModule)
	if err != nil || len(entries) == 0 {
		t.Skipf("no %s here", System.SysModule)
	}
	if System.WouldLoad(entries[0].Name()) {
		t.Errorf("%s is in %s, yet WouldLoad says it would load", entries[0].Name(), System.SysModule)
	}
}

// TestNotLoaded: a module that would load is "not loaded" when the built-in
// list was read; without it (a container without the node's /lib/modules) it
// may be built in, and the message says so and what to mount, rather than
// calling nftables absent on a node whose nf_tables is built in.
func TestNotLoaded(t *testing.T) {
	loaded := []string{"nfnetlink 1 0 - Live 0x0"}
	h := fakeHost(t, nil, loaded, []string{"kernel/net/netfilter/x_tables.ko"}, "")
	if got := h.NotLoaded("nf_tables"); got != "nf_tables is not loaded" {
		t.Errorf("built-ins read: %q, want \"nf_tables is not loaded\"", got)
	}
	h = fakeHost(t, nil, loaded, nil, "")
	got := h.NotLoaded("nf_tables")
	for _, want := range []string{"nf_tables is not loaded, or is built in", "modules.builtin unreadable", "mount the node's " + h.LibModules} {
		if !strings.Contains(got, want) {
			t.Errorf("built-ins unreadable: %q does not say %q", got, want)
		}
	}
}
