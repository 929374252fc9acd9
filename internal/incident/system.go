package incident

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

func (s *snapshot) kernel(_ context.Context, w *topicWriter) error {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return fmt.Errorf("uname: %w", err)
	}
	fmt.Fprintf(w, "kernel release: %s\n", unix.ByteSliceToString(u.Release[:]))
	fmt.Fprintf(w, "kernel version: %s\n", unix.ByteSliceToString(u.Version[:]))
	fmt.Fprintf(w, "machine: %s\n", unix.ByteSliceToString(u.Machine[:]))
	fmt.Fprintf(w, "collected at: %s\n", time.Now().UTC().Format(time.RFC3339))
	fmt.Fprintf(w, "node netns: %s (inode %d)\n", s.hostPath, s.node.HostNetNS.Inode)
	fmt.Fprintf(w, "VIPs: %s\n", joinAddrs(s.vips))

	fmt.Fprintln(w, "\nBPF features pathtrace found:")
	if len(s.opt.Features) == 0 {
		fmt.Fprintln(w, "  (none reported)")
	}
	for _, f := range s.opt.Features {
		fmt.Fprintf(w, "  - %s\n", f)
	}
	fmt.Fprintln(w, "\nWhat discovery could not read, or decided by a fallback:")
	if len(s.node.Notes) == 0 {
		fmt.Fprintln(w, "  (nothing)")
	}
	for _, n := range s.node.Notes {
		fmt.Fprintf(w, "  - %s\n", n)
	}
	return nil
}

// sysctls reads the per-netns sysctls deciding whether bridged and routed
// traffic meets netfilter and passes reverse-path filtering: for the node
// netns and for each netns holding a capture interface.
func (s *snapshot) sysctls(_ context.Context, w *topicWriter) error {
	ifaces := map[string][]string{s.hostPath: nil}
	order := []string{s.hostPath}
	for _, cp := range s.node.CapturePoints {
		path := cp.NetNS
		if path == "" {
			path = s.hostPath
		}
		if _, ok := ifaces[path]; !ok {
			order = append(order, path)
		}
		ifaces[path] = append(ifaces[path], cp.Ifname)
	}
	// The paths whose Pods all went during the incident open nothing of
	// theirs: not a failure to read.
	went, live := map[string]bool{}, map[string]bool{}
	for _, p := range s.node.Pods {
		if podGone(p) {
			went[p.NetNS.Path] = true
		} else {
			live[p.NetNS.Path] = true
		}
	}
	for _, path := range order {
		names := sysctlNames(path == s.hostPath, ifaces[path])
		fmt.Fprintf(w, "# netns %s\n", path)
		if went[path] && !live[path] {
			fmt.Fprintf(w, "the Pod went during the incident: %s\n\n", netnsAfterPod(path))
			continue
		}
		err := nsutil.Do(path, func() error {
			for _, name := range names {
				fmt.Fprintf(w, "%s = %s\n", name, readSysctl(name))
			}
			return nil
		})
		if err != nil {
			fmt.Fprintf(w, "not read: %v\n", err)
			w.notef("netns %s: %v", path, err)
		}
		fmt.Fprintln(w)
	}
	return nil
}

// sysctlNames lists the sysctls read in one netns: rp_filter everywhere, the
// bridge-netfilter, forwarding and conntrack ones in the node's, and there
// each interface's proxy_arp, with which a routed Pod's host veth answers
// for its gateway (Calico's 169.254.1.1).
func sysctlNames(node bool, ifaces []string) []string {
	var names []string
	if node {
		names = append(names,
			"net.bridge.bridge-nf-call-iptables",
			"net.bridge.bridge-nf-call-ip6tables",
			// With 0, frames a bridge carries VLAN-tagged (a tag pushed
			// on a Pod's port) pass by netfilter, whatever the above.
			"net.bridge.bridge-nf-filter-vlan-tagged",
			"net.ipv4.ip_forward",
			"net.ipv6.conf.all.forwarding",
			"net.netfilter.nf_conntrack_count",
			"net.netfilter.nf_conntrack_max",
		)
	}
	names = append(names, "net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter")
	seen := map[string]bool{}
	for _, ifname := range ifaces {
		if ifname != "" && !seen[ifname] {
			seen[ifname] = true
			names = append(names, "net.ipv4.conf."+ifname+".rp_filter")
			if node {
				names = append(names, "net.ipv4.conf."+ifname+".proxy_arp")
			}
		}
	}
	return names
}

// sysctlPath maps a dotted name to its /proc/sys file. Interface names may
// hold dots, so only the fixed prefix is split: net.ipv4.conf.<if>.rp_filter.
func sysctlPath(name string) string {
	const conf = "net.ipv4.conf."
	if rest, ok := strings.CutPrefix(name, conf); ok {
		if i := strings.LastIndexByte(rest, '.'); i > 0 {
			return filepath.Join("/proc/sys/net/ipv4/conf", rest[:i], rest[i+1:])
		}
	}
	return filepath.Join("/proc/sys", strings.ReplaceAll(name, ".", "/"))
}

// readSysctl reads a sysctl from the calling thread's netns (/proc/sys/net is
// resolved for the opener's netns): the value, or why there is none.
func readSysctl(name string) string {
	b, err := os.ReadFile(sysctlPath(name))
	switch {
	case errors.Is(err, os.ErrNotExist):
		return "(absent)"
	case err != nil:
		return fmt.Sprintf("(not read: %v)", err)
	}
	return strings.TrimSpace(string(b))
}

// commandWaitDelay is how long runCommand waits, once its command was
// killed at its context's end, for the command's output to close (a child
// of it may hold it open) before it gives up on the rest.
const commandWaitDelay = time.Second

// runCommand runs a read-only command with its stdout into w, inside the
// netns at nsPath ("" = pathtrace's own). The child inherits the netns of
// the locked thread that starts it.
func runCommand(ctx context.Context, nsPath string, w io.Writer, bin string, args ...string) error {
	stderr := newTopicWriter(4096)
	run := func() error {
		cmd := nsutil.Command(ctx, bin, args...)
		cmd.Stdout, cmd.Stderr = w, stderr
		cmd.Env = append(os.Environ(), "LC_ALL=C")
		cmd.WaitDelay = commandWaitDelay
		return cmd.Run()
	}
	var err error
	if nsPath == "" {
		err = run()
	} else {
		err = nsutil.Do(nsPath, run)
	}
	if err != nil {
		msg, _ := stderr.finish()
		return fmt.Errorf("%s %s: %w %s", bin, strings.Join(args, " "), err, strings.TrimSpace(string(msg)))
	}
	return nil
}
