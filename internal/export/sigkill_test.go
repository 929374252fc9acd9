package export_test

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// childEnv makes the test binary a writer that runs until it is killed.
const childEnv = "PTTEST_EXPORT_WRITE_UNTIL_KILLED"

// stdoutEnv makes the test binary write a capture to stdout (Create("-")).
const stdoutEnv = "PTTEST_EXPORT_STDOUT"

func TestMain(m *testing.M) {
	if path := os.Getenv(childEnv); path != "" {
		writeUntilKilled(path)
	}
	if os.Getenv(stdoutEnv) != "" {
		os.Exit(streamToStdout())
	}
	os.Exit(m.Run())
}

// writeUntilKilled writes packets of every size, tagged or not, with comments
// of varying length, until the parent kills it (or 256 MiB are written).
func writeUntilKilled(path string) {
	w, err := export.Create(path, testIfaces, export.Limits{MaxBytes: 256 << 20})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fmt.Println("ready")
	frames := make([][]byte, 64)
	for i := range frames {
		frames[i] = tcpFrame(i * 23)
	}
	for i := 0; ; i++ {
		p := packet(frames[i%len(frames)], obs.Dir(1+i%2), [3]uint16{0, tpid8021Q, tpid8021AD}[i%3], 200)
		p.Time = t0.Add(time.Duration(i) * time.Microsecond)
		comment := fmt.Sprintf("flow %d request to backend (after translation)%*s", i, i%13, "")
		if err := w.WritePacket(i%len(testIfaces), p, comment); err != nil {
			if errors.Is(err, export.ErrLimit) {
				select {} // wait for the kill
			}
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
}

// TestReadableAfterSIGKILL kills a writer at random moments: what it leaves
// must read without error, by gopacket and by tshark when installed.
func TestReadableAfterSIGKILL(t *testing.T) {
	tshark, _ := exec.LookPath("tshark")
	if tshark == "" {
		t.Log("tshark not installed: checking with the gopacket reader only")
	}
	runs := 12
	if testing.Short() {
		runs = 4
	}
	dir := t.TempDir()
	withPackets := 0
	for run := range runs {
		path := filepath.Join(dir, fmt.Sprintf("kill-%d.pcapng", run))
		// The first runs kill the child while it may still be creating the file.
		early := run < 2
		killChild(t, path, early)
		partial := path + ".partial"
		if _, err := os.Stat(partial); err != nil {
			if early && errors.Is(err, os.ErrNotExist) {
				continue // killed before the file was named: nothing to read
			}
			t.Fatalf("run %d: %v", run, err)
		}
		n, err := readAll(partial)
		if err != nil {
			t.Errorf("run %d: gopacket reads %d packets, then: %v", run, n, err)
		}
		if n > 0 {
			withPackets++
		}
		if tshark != "" {
			if tn, err := tsharkCount(tshark, partial); err != nil || tn != n {
				t.Errorf("run %d: tshark read %d packets (gopacket %d): %v", run, tn, n, err)
			}
		}
		if _, err := os.Stat(path); err == nil {
			t.Errorf("run %d: %s exists although the writer never closed", run, path)
		}
		os.Remove(partial)
	}
	if withPackets < runs/2 {
		t.Errorf("only %d of %d killed writers left packets: the test did not exercise the writer", withPackets, runs)
	}
}

// waitFirstChunk waits until the file at path holds more than its header.
func waitFirstChunk(t *testing.T, path string) {
	t.Helper()
	const header = 4096 // section header and interfaces: far less
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if st, err := os.Stat(path); err == nil && st.Size() > header {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writer wrote nothing past its header to %s in 10 s", path)
		}
	}
}

// killChild starts a writer of path and SIGKILLs it at a random moment: any
// time after start when early, else 0-40 ms after its first chunk reached its file.
func killChild(t *testing.T, path string, early bool) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+path)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if early {
		time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
	} else {
		if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
			t.Fatalf("writer did not start: %q %v", line, err)
		}
		// Killed while writing: once its first chunk is in the file (a
		// loaded machine may start it late, then a kill right after
		// "ready" finds only the header).
		waitFirstChunk(t, path+".partial")
		time.Sleep(time.Duration(rand.IntN(40000)) * time.Microsecond)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
}
