package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

const (
	udpPayload = 64 // a DNS query's size: 106-byte frames, cut by a 96-byte snaplen
	udpBatch   = 64 // datagrams per sendmmsg
)

// udpSender sends datagrams from one unconnected UDP socket, as DNS clients
// do, created inside the Pod's netns.
type udpSender struct {
	netns string
	conn  *net.UDPConn
	pc    *ipv4.PacketConn
}

func openUDPSender(podNetNS string) (*udpSender, error) {
	var conn *net.UDPConn
	err := nsutil.Do(podNetNS, func() error {
		c, err := net.ListenUDP("udp4", &net.UDPAddr{})
		conn = c
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("udp socket in the pod: %w", err)
	}
	return &udpSender{netns: podNetNS, conn: conn, pc: ipv4.NewPacketConn(conn)}, nil
}

func (s *udpSender) Close() error { return s.conn.Close() }

// send sends to dst for d at rate datagrams per second (0: as fast as one
// thread with sendmmsg goes) and returns how many the kernel accepted. A paced
// run sends in batches whenever it is behind its schedule, so short stalls are
// caught up rather than lost. The sending thread is inside the Pod's netns,
// as a Pod's process is: observers that look at the sender's task see a Pod.
func (s *udpSender) send(ctx context.Context, dst netip.AddrPort, rate int, d time.Duration) (sent uint64, elapsed time.Duration, err error) {
	payload := make([]byte, udpPayload)
	addr := net.UDPAddrFromAddrPort(dst)
	msgs := make([]ipv4.Message, udpBatch)
	for i := range msgs {
		msgs[i] = ipv4.Message{Buffers: [][]byte{payload}, Addr: addr}
	}
	start := time.Now()
	err = nsutil.Do(s.netns, func() error {
		for {
			elapsed = time.Since(start)
			if elapsed >= d || ctx.Err() != nil {
				return ctx.Err()
			}
			n := udpBatch
			if rate > 0 {
				due := int64(elapsed.Seconds()*float64(rate)) - int64(sent)
				if due <= 0 {
					time.Sleep(50 * time.Microsecond)
					continue
				}
				n = int(min(due, udpBatch))
			}
			k, err := s.pc.WriteBatch(msgs[:n], 0)
			sent += uint64(k)
			if err != nil && !errors.Is(err, unix.ENOBUFS) {
				return fmt.Errorf("sendmmsg to %s: %w", dst, err)
			}
		}
	})
	return sent, elapsed, err
}

// connectLatencies times n blocking connect() calls to dst from the Pod's
// netns, one new socket each: back to back when every is 0, else one
// starting every that often. Each socket is closed with an RST (SO_LINGER 0)
// so that no TIME_WAIT piles up and slows later port selection.
func connectLatencies(ctx context.Context, podNetNS string, dst netip.AddrPort, n int, every time.Duration) ([]time.Duration, error) {
	sa := &unix.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
	out := make([]time.Duration, 0, n)
	err := nsutil.Do(podNetNS, func() error {
		begin := time.Now()
		for i := range n {
			if err := ctx.Err(); err != nil {
				return err
			}
			if every > 0 {
				time.Sleep(time.Until(begin.Add(time.Duration(i) * every)))
			}
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("socket: %w", err)
			}
			start := time.Now()
			err = unix.Connect(fd, sa)
			took := time.Since(start)
			unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
			unix.Close(fd)
			if err != nil {
				return fmt.Errorf("connect %s: %w", dst, err)
			}
			out = append(out, took)
		}
		return nil
	})
	return out, err
}

// bulkSink is a TCP server that reads and discards everything, counting
// bytes: the far end of the throughput runs.
type bulkSink struct {
	ln    net.Listener
	bytes atomic.Uint64
	conns sync.WaitGroup
}

func startBulkSink(netnsPath string, addr netip.AddrPort) (*bulkSink, error) {
	s := &bulkSink{}
	err := nsutil.Do(netnsPath, func() error {
		ln, err := net.Listen("tcp4", addr.String())
		s.ln = ln
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("bulk sink on %s: %w", addr, err)
	}
	go s.serve()
	return s, nil
}

func (s *bulkSink) serve() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.conns.Add(1)
		go func() {
			defer s.conns.Done()
			defer c.Close()
			buf := make([]byte, 256<<10)
			for {
				n, err := c.Read(buf)
				s.bytes.Add(uint64(n))
				if err != nil {
					return
				}
			}
		}()
	}
}

func (s *bulkSink) Close() error {
	err := s.ln.Close()
	s.conns.Wait()
	return err
}

// bulkThroughput sends as fast as one TCP connection from the Pod to dst
// goes, and returns the rate the sink received during d, after a warm-up
// that lets the congestion window open.
func bulkThroughput(ctx context.Context, podNetNS string, sink *bulkSink, dst netip.AddrPort, d time.Duration) (bitsPerSec float64, err error) {
	var conn net.Conn
	err = nsutil.Do(podNetNS, func() error {
		var derr error
		conn, derr = (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp4", dst.String())
		return derr
	})
	if err != nil {
		return 0, fmt.Errorf("bulk connection: %w", err)
	}
	writeErr := make(chan error, 1)
	go func() {
		buf := make([]byte, 256<<10)
		for {
			if _, err := conn.Write(buf); err != nil {
				writeErr <- err
				return
			}
		}
	}()
	defer func() {
		conn.Close()
		if werr := <-writeErr; !errors.Is(werr, net.ErrClosed) && err == nil {
			err = fmt.Errorf("bulk write: %w", werr)
		}
	}()
	const warmup = 300 * time.Millisecond
	if err := sleepCtx(ctx, warmup); err != nil {
		return 0, err
	}
	b0, t0 := sink.bytes.Load(), time.Now()
	if err := sleepCtx(ctx, d); err != nil {
		return 0, err
	}
	b1, t1 := sink.bytes.Load(), time.Now()
	return float64(b1-b0) * 8 / t1.Sub(t0).Seconds(), nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}
