package export_test

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"testing"

	"github.com/gopacket/gopacket/pcapgo"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// streamToStdout writes 3 packets to Create("-"), then waits for stdin to
// close before it closes the capture.
func streamToStdout() int {
	w, err := export.Create("-", testIfaces, export.Limits{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	for i := range 3 {
		if err := w.WritePacket(i, packet(tcpFrame(100), obs.DirOut, 0, 0), fmt.Sprint("packet ", i)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	}
	io.Copy(io.Discard, os.Stdin)
	if err := w.Close([]export.InterfaceStats{{Received: 3}}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	return 0
}

// TestCreateStdout: with "-" each packet reaches stdout within the flush
// interval (a reader such as `wireshark -k -i -` sees it while the capture
// runs), and the stream ends cleanly at Close.
func TestCreateStdout(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), stdoutEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	r, err := pcapgo.NewNgReader(stdout, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 { // the writer is still running: the flush interval sent them
		_, ci, opts, err := r.ReadPacketDataWithOptions()
		if err != nil || ci.InterfaceIndex != i || len(opts.Comments) != 1 || opts.Comments[0] != fmt.Sprint("packet ", i) {
			t.Fatalf("packet %d while streaming: interface %d comments %q, %v", i, ci.InterfaceIndex, opts.Comments, err)
		}
	}
	stdin.Close()
	if _, _, err := r.ReadPacketData(); !errors.Is(err, io.EOF) {
		t.Errorf("after Close: %v, want a clean end of stream", err)
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("writer: %v", err)
	}
	if ifc, err := r.Interface(0); err != nil || ifc.Statistics.PacketsReceived != 3 {
		t.Errorf("statistics of interface 0: %+v %v", ifc.Statistics, err)
	}
}
