package export_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/gopacket/gopacket/pcapgo"
)

// readback is a capture file as the gopacket reader sees it.
type readback struct {
	packets []readPacket
	ifaces  []pcapgo.NgInterface
	section pcapgo.NgSectionInfo
}

type readPacket struct {
	at          time.Time
	iface       int
	data        []byte
	capLen, len int
	direction   pcapgo.NgEpbFlag
	comments    []string
}

// readAll counts the packets of a pcapng file; it fails unless the file ends
// after a whole block.
func readAll(path string) (int, error) {
	rb, err := read(path)
	return len(rb.packets), err
}

func read(path string) (readback, error) {
	f, err := os.Open(path)
	if err != nil {
		return readback{}, err
	}
	defer f.Close()
	return readFrom(f)
}

func readFrom(r io.Reader) (readback, error) {
	var rb readback
	ng, err := pcapgo.NewNgReader(r, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		return rb, fmt.Errorf("open pcapng: %w", err)
	}
	for {
		data, ci, opts, err := ng.ReadPacketDataWithOptions()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return rb, fmt.Errorf("packet %d: %w", len(rb.packets)+1, err)
		}
		p := readPacket{at: ci.Timestamp, iface: ci.InterfaceIndex, data: bytes.Clone(data), capLen: ci.CaptureLength,
			len: ci.Length, comments: opts.Comments}
		if opts.Flags != nil {
			p.direction = opts.Flags.Direction
		}
		rb.packets = append(rb.packets, p)
	}
	for i := range ng.NInterfaces() {
		ifc, err := ng.Interface(i)
		if err != nil {
			return rb, err
		}
		rb.ifaces = append(rb.ifaces, ifc)
	}
	rb.section = ng.SectionInfo()
	return rb, nil
}

// tsharkFields runs tshark on a file and returns one row of fields per
// packet; any complaint of tshark about the file is an error.
func tsharkFields(tshark, path string, fields ...string) ([][]string, error) {
	args := []string{"-r", path, "-T", "fields", "-E", "separator=|", "-E", "occurrence=a"}
	for _, f := range fields {
		args = append(args, "-e", f)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(tshark, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var complaints []string
	for _, line := range strings.Split(stderr.String(), "\n") {
		if line != "" && !strings.Contains(line, "Running as user \"root\"") {
			complaints = append(complaints, line)
		}
	}
	if err != nil || len(complaints) > 0 {
		return nil, fmt.Errorf("tshark -r %s: %v: %s", path, err, strings.Join(complaints, "; "))
	}
	var rows [][]string
	for _, line := range strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n") {
		if line != "" {
			rows = append(rows, strings.Split(line, "|"))
		}
	}
	return rows, nil
}

func tsharkCount(tshark, path string) (int, error) {
	rows, err := tsharkFields(tshark, path, "frame.number")
	return len(rows), err
}
