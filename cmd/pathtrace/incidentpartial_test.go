package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/incident"
)

// TestIncidentPartialLeftOrBuilding: an --out whose DIR.partial exists is
// refused (exit 2, one line) saying which it is: left by an interrupted
// incident (a SIGKILL, a third Ctrl-C), which may be removed, or being
// built by an incident running now, which must not be. Both said only
// "DIR.partial exists: give a new directory, pathtrace never mixes two
// incidents", as if a bundle were there, where --pcap tells a capture
// running now from one a killed run left.
func TestIncidentPartialLeftOrBuilding(t *testing.T) {
	out := filepath.Join(t.TempDir(), "inc")
	partial := incident.PartialDir(out)
	if err := os.Mkdir(partial, 0o700); err != nil {
		t.Fatal(err)
	}
	check := func(what, want string) {
		t.Helper()
		f := traceFlags{svcs: []string{"10.0.0.1"}, duration: time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
		_, _, err := incidentOptions(&f, out, "256M")
		if err == nil || exitFor(err) != exitUsage || strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v; want a usage error in one line saying %q", what, err, want)
		}
	}
	check("DIR.partial a killed incident left", "left by an interrupted incident: remove it")
	release, err := holdBuilding(partial)
	if err != nil {
		t.Fatal(err)
	}
	check("DIR.partial an incident builds now", "being built by an incident running now")
	release()
	check("DIR.partial once its incident ended", "left by an interrupted incident: remove it")
	if err := os.Mkdir(out, 0o700); err != nil {
		t.Fatal(err)
	}
	check("DIR and DIR.partial", "pathtrace never mixes two incidents")
}
