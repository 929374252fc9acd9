// Package kmod tells whether a request pathtrace would make could have the
// kernel load a module on its behalf. Some netlink requests do: opening a
// NETLINK_NETFILTER socket loads nfnetlink, joining the conntrack event
// groups loads nf_conntrack_netlink (and with it nf_conntrack), listing
// nftables loads nf_tables. Loading a module changes the node, which
// pathtrace never does, so such requests are only made when their modules
// are already there. Nothing here loads or changes anything.
package kmod

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Host is where the kernel's module state is read. System is the running
// kernel's; tests point the paths at a fake tree.
type Host struct {
	SysModule       string // /sys/module: a directory per loaded module (and per built-in one with parameters)
	ProcModules     string // /proc/modules: the loaded modules; absent when the kernel has no module support
	ModulesDisabled string // /proc/sys/kernel/modules_disabled: 1 once loading is switched off for good
	LibModules      string // /lib/modules: RELEASE/modules.builtin lists the built-in modules
	Release         string // the kernel release; "" = the running kernel's (uname -r)
}

// System is the running kernel.
var System = Host{
	SysModule:       "/sys/module",
	ProcModules:     "/proc/modules",
	ModulesDisabled: "/proc/sys/kernel/modules_disabled",
	LibModules:      "/lib/modules",
}

// The modules a request needs, in the order it would load them. Conntrack:
// a NETLINK_NETFILTER socket requests nfnetlink, joining or dumping
// conntrack requests nf_conntrack_netlink, which brings nf_conntrack.
// NFTables: listing the ruleset requests nfnetlink and nf_tables.
var (
	Conntrack = []string{"nfnetlink", "nf_conntrack", "nf_conntrack_netlink"}
	NFTables  = []string{"nfnetlink", "nf_tables"}
)

// FirstToLoad is System.FirstToLoad.
func FirstToLoad(names ...string) string { return System.FirstToLoad(names...) }

// WouldLoad tells whether a request for the subsystem of module name could
// make the kernel load it: the kernel can load modules, and name is neither
// loaded nor built in. When it cannot tell (modules.builtin unreadable, as
// in a container without /lib/modules), it says the module would load:
// pathtrace then leaves the request out rather than risk changing the node.
func (h Host) WouldLoad(name string) bool {
	name = canonical(name)
	if _, err := os.Stat(filepath.Join(h.SysModule, name)); err == nil {
		return false // loaded, or built in with parameters
	}
	mods, err := os.ReadFile(h.ProcModules)
	if err != nil {
		return false // no module support: what exists is built in
	}
	if b, err := os.ReadFile(h.ModulesDisabled); err == nil && strings.TrimSpace(string(b)) == "1" {
		return false // loading is switched off until the next boot
	}
	if listsModule(mods, name, func(line string) string {
		if f := strings.Fields(line); len(f) > 0 {
			return f[0]
		}
		return ""
	}) {
		return false
	}
	release := h.Release
	if release == "" {
		var u unix.Utsname
		if unix.Uname(&u) != nil {
			return true
		}
		release = unix.ByteSliceToString(u.Release[:])
	}
	builtin, err := os.ReadFile(filepath.Join(h.LibModules, release, "modules.builtin"))
	if err != nil {
		return true
	}
	// Lines are paths: kernel/net/netfilter/nf_conntrack_netlink.ko
	return !listsModule(builtin, name, func(line string) string {
		return strings.TrimSuffix(filepath.Base(strings.TrimSpace(line)), ".ko")
	})
}

// NotLoaded says that module name (one FirstToLoad returned) is not there:
// "nf_tables is not loaded", or, when the built-in modules could not be read
// (a container without the node's /lib/modules), that it may be built in
// where pathtrace cannot see, and how to let it see.
func (h Host) NotLoaded(name string) string {
	release := h.Release
	if release == "" {
		var u unix.Utsname
		if unix.Uname(&u) == nil {
			release = unix.ByteSliceToString(u.Release[:])
		}
	}
	path := filepath.Join(h.LibModules, release, "modules.builtin")
	if _, err := os.Stat(path); err == nil {
		return name + " is not loaded"
	}
	return fmt.Sprintf("%s is not loaded, or is built in where pathtrace cannot tell (%s unreadable: in a container, mount the node's %s in)", name, path, h.LibModules)
}

// NotLoaded is System.NotLoaded.
func NotLoaded(name string) string { return System.NotLoaded(name) }

// FirstToLoad returns the first of names that WouldLoad, "" when none.
func (h Host) FirstToLoad(names ...string) string {
	for _, n := range names {
		if h.WouldLoad(n) {
			return n
		}
	}
	return ""
}

// canonical is a module's name as the kernel lists it: '-' and '_' are the
// same in module names, and /sys/module and /proc/modules use '_'.
func canonical(name string) string { return strings.ReplaceAll(name, "-", "_") }

// listsModule tells whether a line of text names module name (canonical),
// the name of a line being what field returns.
func listsModule(text []byte, name string, field func(string) string) bool {
	sc := bufio.NewScanner(bytes.NewReader(text))
	for sc.Scan() {
		if canonical(field(sc.Text())) == name {
			return true
		}
	}
	return false
}
