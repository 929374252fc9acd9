package main

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/pathtrace/pathtrace/internal/export"
)

// TestIncidentOutTrailingSlash: an --out written with a trailing slash
// (--out /var/tmp/inc-42/) names the same new directory and is taken, not
// refused with "no directory /var/tmp/inc-42 to create it in".
func TestIncidentOutTrailingSlash(t *testing.T) {
	f := traceFlags{svcs: []string{"10.0.0.1"}, duration: time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
	out := filepath.Join(t.TempDir(), "inc-42") + "/"
	opt, _, err := incidentOptions(&f, out, "256M")
	if err != nil {
		t.Fatalf("--out %s: %v; want it taken", out, err)
	}
	if want := strings.TrimSuffix(out, "/") + ".partial/" + captureFile; opt.Pcap != want {
		t.Errorf("capture in %s; want %s", opt.Pcap, want)
	}
}

// TestIncidentNegativeDuration: a negative --duration's message must not
// offer 0 ("until stopped"), which an incident refuses.
func TestIncidentNegativeDuration(t *testing.T) {
	f := traceFlags{svcs: []string{"10.0.0.1"}, duration: -time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
	_, _, err := incidentOptions(&f, filepath.Join(t.TempDir(), "inc"), "256M")
	if err == nil {
		t.Fatal("--duration -1s taken")
	}
	if strings.Contains(err.Error(), "until stopped") && !strings.Contains(err.Error(), "without incident") {
		t.Errorf("--duration -1s: %q offers --duration 0, which incident refuses", err)
	}
}

// TestCommandLineQuotedBinary: a binary whose path needs quoting is named
// by its base name, with no stray quote left from the path's quoting.
func TestCommandLineQuotedBinary(t *testing.T) {
	got := commandLine([]string{"/opt/my tools/pathtrace", "incident", "--svc", "10.120.0.80"})
	if want := "pathtrace incident --svc 10.120.0.80"; got != want {
		t.Errorf("commandLine = %q; want %q", got, want)
	}
}

// TestIncidentHelpNamesFlagsNotTaken: the incident's help says which of the
// main command's flags it does not take; every one it refuses is named.
func TestIncidentHelpNamesFlagsNotTaken(t *testing.T) {
	var f traceFlags
	inc := pflag.NewFlagSet("incident", pflag.ContinueOnError)
	addSelectionFlags(inc, &f)
	_, but, _ := strings.Cut(incidentUsage, "It takes the flags of the main command but")
	but, _, _ = strings.Cut(but, ".\n")
	named := strings.FieldsFunc(but, func(r rune) bool { return strings.ContainsRune(" ,()\n", r) })
	newTraceFlagSet(&f).VisitAll(func(fl *pflag.Flag) {
		if inc.Lookup(fl.Name) == nil && fl.Name != "max-bytes" && !slices.Contains(named, "--"+fl.Name) {
			t.Errorf("pathtrace incident refuses --%s, which its help does not name among the flags it does not take: %q", fl.Name, but)
		}
	})
}

// TestIncidentHelpNamesSnapshot: the incident's help names what the
// snapshot holds that an escalation looks for: the XDP programs in tc.txt,
// iptables-legacy's filter table (a Service without endpoints is rejected
// there) beside its nat table.
func TestIncidentHelpNamesSnapshot(t *testing.T) {
	for _, want := range []string{"XDP", "iptables-legacy nat and filter tables"} {
		if !strings.Contains(strings.Join(strings.Fields(incidentUsage), " "), want) {
			t.Errorf("pathtrace incident --help does not name %q among the snapshot's parts", want)
		}
	}
}

// TestIncidentSecondStopSaysWhy: the stop signal that cuts the snapshot
// short (the second) cancels the bundle's context with its cause, which
// the manifest's notes say ("not collected: interrupted by a stop
// signal"), not "context canceled".
func TestIncidentSecondStopSaysWhy(t *testing.T) {
	capture, bundle, _, release := incidentStops()
	defer release()
	for i, ctx := range []context.Context{capture, bundle} {
		if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("stop signal %d: its context not cancelled", i+1)
		}
	}
	if why := context.Cause(bundle).Error(); why != "interrupted by a stop signal" {
		t.Errorf("the bundle's context cancelled because %q, want the stop signal", why)
	}
}

// TestBundlePcapNamesFileInBundle: the bundle's reports name its capture
// within the bundle, its write error too (a full disk): the bundle was
// built as DIR.partial, then renamed and archived.
func TestBundlePcapNamesFileInBundle(t *testing.T) {
	p := &export.Summary{Path: "/var/tmp/inc-42.partial/capture.pcapng", Error: "write pcapng: write /var/tmp/inc-42.partial/capture.pcapng: no space left on device"}
	got := bundlePcap(p)
	if got.Path != captureFile || got.Error != "write pcapng: write capture.pcapng: no space left on device" {
		t.Errorf("in the bundle: %q, %q; want %s named within it", got.Path, got.Error, captureFile)
	}
	if p.Path != "/var/tmp/inc-42.partial/capture.pcapng" {
		t.Errorf("the run's summary changed: %q", p.Path)
	}
}
