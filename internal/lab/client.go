package lab

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ClientOptions shape a run of the lab client.
type ClientOptions struct {
	Requests int           `json:"requests"` // per protocol; 0 means 1
	Interval time.Duration `json:"interval"` // pause between rounds (one TCP + one UDP request)
	Timeout  time.Duration `json:"timeout"`  // per request; 0 means 1s
}

func (o ClientOptions) withDefaults() ClientOptions {
	if o.Requests <= 0 {
		o.Requests = 1
	}
	if o.Timeout <= 0 {
		o.Timeout = time.Second
	}
	return o
}

// FailureKind classifies a failed request.
type FailureKind string

const (
	FailUnreachable FailureKind = "unreachable" // an ICMP error came back (fast failure)
	FailRefused     FailureKind = "refused"
	FailTimeout     FailureKind = "timeout"
	FailBadReply    FailureKind = "bad-reply" // an answer, but not the Service's
	FailOther       FailureKind = "error"
)

// RequestResult is one request.
type RequestResult struct {
	OK       bool          `json:"ok"`
	Start    time.Time     `json:"start"`
	Local    string        `json:"local,omitempty"` // the client's address:port, when known
	Peer     string        `json:"peer,omitempty"`  // TCP: getpeername(); UDP: the reply's source
	Kind     FailureKind   `json:"kind,omitempty"`
	Error    string        `json:"error,omitempty"`
	Duration time.Duration `json:"duration"`
}

// ProtoResult is every request of one protocol.
type ProtoResult struct {
	Target   string          `json:"target"` // the VIP
	OK       int             `json:"ok"`
	Failed   int             `json:"failed"`
	Requests []RequestResult `json:"requests"`
}

func (p *ProtoResult) add(r RequestResult) {
	if r.OK {
		p.OK++
	} else {
		p.Failed++
	}
	p.Requests = append(p.Requests, r)
}

// ClientResult is what a client run saw.
type ClientResult struct {
	TCP ProtoResult `json:"tcp"`
	UDP ProtoResult `json:"udp"`
}

// Client runs the lab client: a process started inside the client cgroup (so
// the socket LB applies to it) that joins the Pod's netns and sends
// opt.Requests HTTP requests, each on a new TCP connection, to TCPVIP and as
// many datagrams, each from a new unconnected UDP socket, to UDPVIP. A request
// succeeds when the answer is right and comes from the VIP.
func (l *Lab) Client(ctx context.Context, opt ClientOptions) (ClientResult, error) {
	opt = opt.withDefaults()
	if !isNetNS(l.PodNetNS()) {
		return ClientResult{}, fmt.Errorf("lab %s is not up: no pod netns %s; run `%s`", l.name, l.PodNetNS(), l.Command("up"))
	}
	cg, err := os.Open(l.ClientCgroup())
	if err != nil {
		return ClientResult{}, fmt.Errorf("lab %s is not up: client cgroup: %w; run `%s`", l.name, err, l.Command("up"))
	}
	defer cg.Close()
	exe, err := os.Executable()
	if err != nil {
		return ClientResult{}, fmt.Errorf("find own executable: %w", err)
	}
	optJSON, err := json.Marshal(opt)
	if err != nil {
		return ClientResult{}, err
	}

	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, exe)
	cmd.Env = l.workerEnv(workerClient, l.PodNetNS(), envClient+"="+string(optJSON))
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// Born inside the cgroup (clone3 CLONE_INTO_CGROUP): every socket it makes
	// is the cgroup's from the start. It dies with its parent, even by
	// SIGKILL (a test's timeout, timeout -s KILL), which cannot cancel ctx:
	// it would otherwise go on sending its requests to the Services, into
	// the traces run after, until its --requests were done.
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd()), Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		return ClientResult{}, fmt.Errorf("lab client: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	var res ClientResult
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		return ClientResult{}, fmt.Errorf("lab client output: %w", err)
	}
	return res, nil
}

// runClientWorker is the client process: it prints its ClientResult as JSON.
func runClientWorker() error {
	var opt ClientOptions
	if err := json.Unmarshal([]byte(os.Getenv(envClient)), &opt); err != nil {
		return fmt.Errorf("client options: %w", err)
	}
	if err := joinNetNS(os.Getenv(envNetNS)); err != nil {
		return err
	}
	res := ClientResult{TCP: ProtoResult{Target: TCPVIP.String()}, UDP: ProtoResult{Target: UDPVIP.String()}}
	for i := range opt.Requests {
		if i > 0 && opt.Interval > 0 {
			time.Sleep(opt.Interval)
		}
		res.TCP.add(timed(func() RequestResult { return tcpRequest(TCPVIP, opt.Timeout) }))
		res.UDP.add(timed(func() RequestResult { return udpRequest(UDPVIP, i, opt.Timeout) }))
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

func timed(fn func() RequestResult) RequestResult {
	start := time.Now()
	r := fn()
	r.Start, r.Duration = start, time.Since(start)
	return r
}

// tcpRequest connects to vip and GETs "/". The socket reports ICMP errors
// (IP_RECVERR): when the ICMP error arrives while connect() still holds the
// socket, the kernel only records it as a soft error, and without RECVERR
// nothing would wake the connect until the SYN is retransmitted a second later.
func tcpRequest(vip netip.AddrPort, timeout time.Duration) RequestResult {
	d := net.Dialer{Timeout: timeout, Control: recvErrControl}
	conn, err := d.Dial("tcp4", vip.String())
	if err != nil {
		return failure(err)
	}
	defer conn.Close()
	local := conn.LocalAddr().String()
	peer := conn.RemoteAddr().String() // getpeername(): the VIP unless a translation leaks
	conn.SetDeadline(time.Now().Add(timeout))
	if _, err := fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", vip); err != nil {
		return withAddrs(failure(err), local, peer)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return withAddrs(failure(err), local, peer)
	}
	resp.Body.Close()
	switch {
	case resp.StatusCode != http.StatusOK:
		return withAddrs(badReply("HTTP status %d", resp.StatusCode), local, peer)
	case peer != vip.String():
		return withAddrs(badReply("connected to %s, not the VIP", peer), local, peer)
	}
	return RequestResult{OK: true, Local: local, Peer: peer}
}

// udpRequest sends one datagram from a new unconnected socket (sendto) and
// waits for the echo (recvfrom), which must come from the VIP.
func udpRequest(vip netip.AddrPort, seq int, timeout time.Duration) RequestResult {
	lc := net.ListenConfig{Control: recvErrControl}
	pc, err := lc.ListenPacket(context.Background(), "udp4", ":0")
	if err != nil {
		return failure(err)
	}
	conn := pc.(*net.UDPConn)
	defer conn.Close()
	local := conn.LocalAddr().String()
	conn.SetDeadline(time.Now().Add(timeout))
	msg := fmt.Sprintf("pathtrace lab request %d", seq)
	if _, err := conn.WriteToUDPAddrPort([]byte(msg), vip); err != nil {
		return withAddrs(failure(err), local, "")
	}
	buf := make([]byte, 2048)
	n, from, err := conn.ReadFromUDPAddrPort(buf)
	if err != nil {
		return withAddrs(failure(err), local, "")
	}
	from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
	switch {
	case from != vip:
		return withAddrs(badReply("reply from %s, not the VIP", from), local, from.String())
	case string(buf[:n]) != msg:
		return withAddrs(badReply("reply %q is not the echo", buf[:n]), local, from.String())
	}
	return RequestResult{OK: true, Local: local, Peer: from.String()}
}

// recvErrControl sets IP_RECVERR so ICMP errors fail a request at once.
func recvErrControl(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_RECVERR, 1)
	})
	return errors.Join(err, serr)
}

func failure(err error) RequestResult {
	return RequestResult{Kind: classify(err), Error: err.Error()}
}

func withAddrs(r RequestResult, local, peer string) RequestResult {
	r.Local, r.Peer = local, peer
	return r
}

func badReply(format string, a ...any) RequestResult {
	return RequestResult{Kind: FailBadReply, Error: fmt.Sprintf(format, a...)}
}

// classify names the cause of a failed request.
func classify(err error) FailureKind {
	var nerr net.Error
	switch {
	case errors.Is(err, unix.EHOSTUNREACH), errors.Is(err, unix.ENETUNREACH):
		return FailUnreachable
	case errors.Is(err, unix.ECONNREFUSED):
		return FailRefused
	case errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &nerr) && nerr.Timeout():
		return FailTimeout
	}
	return FailOther
}
