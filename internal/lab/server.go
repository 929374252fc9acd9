package lab

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// runServer is the backend worker: HTTP on TCPBackend, a UDP echo on
// UDPBackend, inside the backend netns. It writes its PID file once both
// sockets listen, which is how `up` knows the backend is ready.
func runServer() error {
	if err := joinNetNS(os.Getenv(envNetNS)); err != nil {
		return err
	}
	tcp, err := net.Listen("tcp4", TCPBackend.String())
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	udp, err := net.ListenPacket("udp4", UDPBackend.String())
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	if err := writePIDFile(os.Getenv(envPIDFile)); err != nil {
		return err
	}
	errc := make(chan error, 2)
	go func() {
		errc <- http.Serve(tcp, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "pathtrace lab backend %s: hello %s\n", TCPBackend, r.RemoteAddr)
		}))
	}()
	go func() { errc <- serveEcho(udp) }()
	return <-errc
}

// serveEcho answers every datagram with its own payload.
func serveEcho(conn net.PacketConn) error {
	buf := make([]byte, 2048)
	for {
		n, from, err := conn.ReadFrom(buf)
		if err != nil {
			return fmt.Errorf("udp echo: %w", err)
		}
		if _, err := conn.WriteTo(buf[:n], from); err != nil {
			fmt.Fprintf(os.Stderr, "udp echo to %s: %v\n", from, err)
		}
	}
}

// startServer starts the backend worker as a detached process (its own
// session, output to the state dir's log) and waits until it listens.
func (l *Lab) startServer() error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable: %w", err)
	}
	logf, err := os.OpenFile(l.serverLog(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("server log: %w", err)
	}
	defer logf.Close()
	os.Remove(l.serverPIDFile())

	cmd := exec.Command(exe)
	cmd.Env = l.workerEnv(workerServer, l.BackendNetNS(), envPIDFile+"="+l.serverPIDFile())
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = "/" // hold no directory of whoever ran up
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start server worker: %w", err)
	}
	// Reap the worker should it exit while this process lives (a test binary);
	// after this process exits, init adopts it.
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		close(exited)
	}()

	deadline := time.After(10 * time.Second)
	for {
		if pid, err := readPIDFile(l.serverPIDFile()); err == nil && pid == cmd.Process.Pid {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("server worker exited: %s", lastLines(l.serverLog(), 3))
		case <-deadline:
			return errors.New("server worker did not start listening within 10s")
		case <-time.After(10 * time.Millisecond):
		}
	}
}
