package tcp_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
)

// The two-process benchmarks run the peer in a child process (this test
// binary, running TestLatencyPeer), as rblk's initiator and target run:
// each side has its own scheduler.

const (
	envPeerNet  = "RBLK_BENCH_PEER_NET"  // the child is the peer on this network
	envPeerMode = "RBLK_BENCH_PEER_MODE" // "poll" or "handler"
	envPeerAddr = "RBLK_BENCH_PEER_ADDR" // where it listens
)

// TestLatencyPeer is the peer process of BenchmarkLatency2P; it skips
// unless run by it. It listens, accepts one connection with the address
// and rkey of a 4 KiB region as private data, answers every SEND with a
// SEND of the same length, and exits when the connection closes.
func TestLatencyPeer(t *testing.T) {
	network := os.Getenv(envPeerNet)
	if network == "" {
		t.Skip("the peer process of BenchmarkLatency2P")
	}
	if err := runPeer(network, os.Getenv(envPeerMode), os.Getenv(envPeerAddr)); err != nil {
		t.Fatal(err)
	}
}

func runPeer(network, mode, addr string) error {
	ctx := context.Background()
	p := tcp.New(network)
	l, err := p.Listen(ctx, addr)
	if err != nil {
		return err
	}
	fmt.Printf("listening %s\n", l.Addr())
	req, err := l.Accept(ctx)
	if err != nil {
		return err
	}
	c, err := req.Prepare()
	if err != nil {
		return err
	}
	all := transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite
	r, err := c.Register(make([]byte, 8192), all)
	if err != nil {
		return err
	}
	recv := []transport.RecvRequest{{ID: 1, Local: transport.SGE{Region: r, Offset: 4096, Length: 4096}}}
	reply := []transport.WorkRequest{{ID: 2, Op: transport.OpSend, Local: transport.SGE{Region: r}}}
	if err := c.PostRecv(recv...); err != nil {
		return err
	}
	pd := binary.BigEndian.AppendUint64(nil, r.Addr())
	pd = binary.BigEndian.AppendUint32(pd, r.RKey())
	if _, err := req.Accept(ctx, pd); err != nil {
		return err
	}
	l.Close()
	defer c.Close()
	answer := func(cs []transport.Completion) error {
		for _, comp := range cs {
			if comp.Status != transport.StatusSuccess {
				return comp.Err()
			}
			if comp.Op != transport.OpRecv {
				continue
			}
			if err := c.PostRecv(recv...); err != nil {
				return err
			}
			reply[0].Local.Length = comp.ByteLen
			if err := c.PostSend(reply...); err != nil {
				return err
			}
		}
		return nil
	}
	if mode == "handler" {
		h, ok := c.(transport.CompletionHandler)
		if !ok {
			return errors.New("no CompletionHandler")
		}
		done := make(chan error, 1)
		h.HandleCompletions(func(cs []transport.Completion, err error) {
			if err != nil {
				done <- nil
				return
			}
			if err := answer(cs); err != nil {
				c.Close()
			}
		})
		return <-done
	}
	out := make([]transport.Completion, 16)
	for {
		n, err := c.Poll(ctx, out)
		if errors.Is(err, transport.ErrClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := answer(out[:n]); err != nil {
			return nil // flushed at the end
		}
	}
}

// startPeer runs the peer process and dials it.
func startPeer(b *testing.B, network, mode string) (c transport.Conn, raddr uint64, rkey uint32) {
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(b.TempDir(), "s")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLatencyPeer$", "-test.count=1")
	cmd.Env = append(os.Environ(), envPeerNet+"="+network, envPeerMode+"="+mode, envPeerAddr+"="+addr)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		done := make(chan struct{})
		go func() {
			cmd.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		b.Fatal(err)
	}
	laddr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	if !ok {
		b.Fatalf("peer said %q", line)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err = tcp.New(network).Dial(ctx, laddr, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	pd := c.PeerPrivateData()
	if len(pd) != 12 {
		b.Fatalf("private data %x", pd)
	}
	return c, binary.BigEndian.Uint64(pd), binary.BigEndian.Uint32(pd[8:])
}

// BenchmarkLatency2P is BenchmarkLatency with the peer in another
// process (both sides in the same mode). CPU time is this process's.
func BenchmarkLatency2P(b *testing.B) {
	for _, network := range []string{"unix", "tcp"} {
		for _, mode := range []string{"poll", "handler"} {
			b.Run("PingPong/"+network+"/"+mode, func(b *testing.B) { bench2P(b, network, mode, false) })
			b.Run("Read4K/"+network+"/"+mode, func(b *testing.B) { bench2P(b, network, mode, true) })
		}
	}
}

func bench2P(b *testing.B, network, mode string, read bool) {
	const size = 4096
	a, raddr, rkey := startPeer(b, network, mode)
	ra, err := a.Register(make([]byte, 2*size), transport.AccessLocalWrite)
	if err != nil {
		b.Fatal(err)
	}
	var wr transport.WorkRequest
	if read {
		wr = transport.WorkRequest{ID: 1, Op: transport.OpRead, Local: transport.SGE{Region: ra, Length: size}, RemoteAddr: raddr, RKey: rkey}
		b.SetBytes(size)
	} else {
		wr = transport.WorkRequest{ID: 1, Op: transport.OpSend, Local: transport.SGE{Region: ra, Length: 64}}
	}
	wrs := []transport.WorkRequest{wr} // reused: no allocation per post
	recv := []transport.RecvRequest{{ID: 3, Local: transport.SGE{Region: ra, Offset: size, Length: size}}}
	// One op is done when this completes: the READ, or the answer's RECV.
	last := transport.OpRead
	if !read {
		last = transport.OpRecv
		if err := a.PostRecv(recv...); err != nil {
			b.Fatal(err)
		}
	}
	var h transport.CompletionHandler
	if mode == "handler" {
		h = handler(b, a)
	}
	b.ReportAllocs()
	b.ResetTimer()
	defer reportCPU(b, cpuTime())
	if h != nil {
		done := make(chan error, 1)
		left := b.N
		h.HandleCompletions(func(cs []transport.Completion, err error) {
			if err != nil {
				return
			}
			for _, c := range cs {
				if c.Status != transport.StatusSuccess {
					done <- c.Err()
					return
				}
				if c.Op != last {
					continue
				}
				if left--; left == 0 {
					done <- nil
					return
				}
				if !read {
					if err := a.PostRecv(recv...); err != nil {
						done <- err
						return
					}
				}
				if err := a.PostSend(wrs...); err != nil {
					done <- err
					return
				}
			}
		})
		if err := a.PostSend(wrs...); err != nil {
			b.Fatal(err)
		}
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		return
	}
	ctx := context.Background()
	out := make([]transport.Completion, 4)
	for range b.N {
		if err := a.PostSend(wrs...); err != nil {
			b.Fatal(err)
		}
		for got := false; !got; {
			n, err := a.Poll(ctx, out)
			if err != nil {
				b.Fatal(err)
			}
			for _, c := range out[:n] {
				if c.Status != transport.StatusSuccess {
					b.Fatal(c.Err())
				}
				if c.Op == last {
					got = true
				}
			}
		}
		if !read {
			if err := a.PostRecv(recv...); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
}
