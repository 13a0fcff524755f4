package tcp_test

import (
	"context"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
)

// benchPair connects a pair over TCP loopback and registers a region of
// size bytes on each side.
func benchPair(b *testing.B, size int) (a, p transport.Conn, ra, rp transport.Region) {
	a, p = transporttest.Connect(b, tcp.New("tcp"), "127.0.0.1:0")
	all := transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite
	var err error
	if ra, err = a.Register(make([]byte, size), all); err != nil {
		b.Fatal(err)
	}
	if rp, err = p.Register(make([]byte, size), all); err != nil {
		b.Fatal(err)
	}
	return a, p, ra, rp
}

// cpuTime is the CPU time the process used so far, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU reports the CPU time per op since start (both sides of the
// connection run in this process).
func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
}

// benchOneSided keeps depth requests of op and size bytes in flight.
func benchOneSided(b *testing.B, op transport.Opcode, size, depth int) {
	a, _, ra, rp := benchPair(b, size*depth)
	wrs := make([]transport.WorkRequest, 1) // reused: no allocation per post
	out := make([]transport.Completion, 64)
	ctx := context.Background()
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	defer reportCPU(b, cpuTime())
	posted, completed := 0, 0
	for completed < b.N {
		for posted < b.N && posted-completed < depth {
			slot := posted % depth
			wrs[0] = transport.WorkRequest{
				ID: uint64(posted), Op: op,
				Local:      transport.SGE{Region: ra, Offset: slot * size, Length: size},
				RemoteAddr: rp.Addr() + uint64(slot*size), RKey: rp.RKey(),
			}
			if err := a.PostSend(wrs...); err != nil {
				b.Fatal(err)
			}
			posted++
		}
		n, err := a.Poll(ctx, out)
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range out[:n] {
			if c.Status != transport.StatusSuccess {
				b.Fatal(c.Err())
			}
		}
		completed += n
	}
}

func BenchmarkWrite4K(b *testing.B) { benchOneSided(b, transport.OpWrite, 4096, 64) }
func BenchmarkRead4K(b *testing.B)  { benchOneSided(b, transport.OpRead, 4096, 64) }
func BenchmarkRead1M(b *testing.B)  { benchOneSided(b, transport.OpRead, 1<<20, 8) }
func BenchmarkWrite1M(b *testing.B) { benchOneSided(b, transport.OpWrite, 1<<20, 8) }

// BenchmarkWrite4KLatency has one request in flight: a round trip each.
func BenchmarkWrite4KLatency(b *testing.B) { benchOneSided(b, transport.OpWrite, 4096, 1) }

// BenchmarkSendRecv sends 4 KiB messages while the peer keeps receives
// posted and reposts each as it completes.
func BenchmarkSendRecv(b *testing.B) {
	const size, depth = 4096, 64
	a, p, ra, rp := benchPair(b, size*depth)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rrs := make([]transport.RecvRequest, 1)
	for i := range 2 * depth {
		rrs[0] = transport.RecvRequest{ID: uint64(i % depth), Local: transport.SGE{Region: rp, Offset: (i % depth) * size, Length: size}}
		if err := p.PostRecv(rrs...); err != nil {
			b.Fatal(err)
		}
	}
	recvErr := make(chan error, 1)
	go func() {
		out := make([]transport.Completion, 64)
		rrs := make([]transport.RecvRequest, 1)
		for got := 0; got < b.N; {
			n, err := p.Poll(ctx, out)
			if err != nil {
				recvErr <- err
				return
			}
			for _, c := range out[:n] {
				if c.Status != transport.StatusSuccess || c.ByteLen != size {
					recvErr <- c.Err()
					return
				}
				rrs[0] = transport.RecvRequest{ID: c.ID, Local: transport.SGE{Region: rp, Offset: int(c.ID) * size, Length: size}}
				if err := p.PostRecv(rrs...); err != nil {
					recvErr <- err
					return
				}
			}
			got += n
		}
		recvErr <- nil
	}()
	wrs := make([]transport.WorkRequest, 1)
	out := make([]transport.Completion, 64)
	b.SetBytes(size)
	b.ReportAllocs()
	b.ResetTimer()
	posted, completed := 0, 0
	for completed < b.N {
		for posted < b.N && posted-completed < depth {
			slot := posted % depth
			wrs[0] = transport.WorkRequest{ID: uint64(posted), Op: transport.OpSend, Local: transport.SGE{Region: ra, Offset: slot * size, Length: size}}
			if err := a.PostSend(wrs...); err != nil {
				b.Fatal(err)
			}
			posted++
		}
		n, err := a.Poll(ctx, out)
		if err != nil {
			b.Fatal(err)
		}
		completed += n
	}
	if err := <-recvErr; err != nil {
		b.Fatal(err)
	}
}

// BenchmarkGrantRegister is the cost of a grant without memory windows: a
// Register and Deregister of 1 MiB.
func BenchmarkGrantRegister(b *testing.B) {
	a, _ := transporttest.Connect(b, tcp.New("tcp"), "127.0.0.1:0")
	transporttest.BenchGrantRegister(b, a)
}

// BenchmarkGrantWindow is the cost of a grant with a memory window: a
// BindWindow and Invalidate of 1 MiB of memory registered once.
func BenchmarkGrantWindow(b *testing.B) {
	a, _ := transporttest.Connect(b, tcp.New("tcp"), "127.0.0.1:0")
	transporttest.BenchGrantWindow(b, a)
}

// latencyPair connects a pair over network ("tcp" or "unix") and registers
// a region of size bytes on each side.
func latencyPair(b *testing.B, network string, size int) (a, p transport.Conn, ra, rp transport.Region) {
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(b.TempDir(), "s")
	}
	a, p = transporttest.Connect(b, tcp.New(network), addr)
	all := transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite
	var err error
	if ra, err = a.Register(make([]byte, size), all); err != nil {
		b.Fatal(err)
	}
	if rp, err = p.Register(make([]byte, size), all); err != nil {
		b.Fatal(err)
	}
	return a, p, ra, rp
}

// handler returns c as a CompletionHandler, or skips b.
func handler(b *testing.B, c transport.Conn) transport.CompletionHandler {
	h, ok := c.(transport.CompletionHandler)
	if !ok {
		b.Skipf("%T does not implement transport.CompletionHandler", c)
	}
	return h
}

// BenchmarkLatency measures round trips at queue depth 1 between two
// conns of one process, over unix sockets and TCP loopback, with
// completions taken by Poll or by a CompletionHandler:
//
//   - PingPong: a 64-byte SEND answered by a 64-byte SEND (each side's
//     SEND signaled, its RECV reposted at once);
//   - Read4K: a 4 KiB RDMA READ.
//
// One op is one round trip.
func BenchmarkLatency(b *testing.B) {
	for _, network := range []string{"unix", "tcp"} {
		for _, mode := range []string{"poll", "handler"} {
			b.Run("PingPong/"+network+"/"+mode, func(b *testing.B) { benchPingPong(b, network, mode == "handler") })
			b.Run("Read4K/"+network+"/"+mode, func(b *testing.B) { benchRead4K(b, network, mode == "handler") })
		}
	}
}

func benchPingPong(b *testing.B, network string, useHandler bool) {
	const size = 64
	a, p, ra, rp := latencyPair(b, network, 2*size)
	var ha, hp transport.CompletionHandler
	if useHandler {
		ha, hp = handler(b, a), handler(b, p)
	}
	ping := []transport.WorkRequest{{ID: 1, Op: transport.OpSend, Local: transport.SGE{Region: ra, Length: size}}}
	pong := []transport.WorkRequest{{ID: 2, Op: transport.OpSend, Local: transport.SGE{Region: rp, Length: size}}}
	recvA := []transport.RecvRequest{{ID: 3, Local: transport.SGE{Region: ra, Offset: size, Length: size}}}
	recvP := []transport.RecvRequest{{ID: 4, Local: transport.SGE{Region: rp, Offset: size, Length: size}}}
	if err := a.PostRecv(recvA...); err != nil {
		b.Fatal(err)
	}
	if err := p.PostRecv(recvP...); err != nil {
		b.Fatal(err)
	}
	fail := make(chan error, 2)
	report := func(err error) {
		select {
		case fail <- err:
		default:
		}
	}
	// The peer answers every ping.
	answer := func(cs []transport.Completion) {
		for _, c := range cs {
			if c.Status != transport.StatusSuccess {
				report(c.Err())
				return
			}
			if c.Op == transport.OpRecv {
				if err := p.PostRecv(recvP...); err != nil {
					report(err)
				}
				if err := p.PostSend(pong...); err != nil {
					report(err)
				}
			}
		}
	}
	done := make(chan struct{})
	b.ReportAllocs()
	b.ResetTimer()
	defer reportCPU(b, cpuTime())
	if useHandler {
		hp.HandleCompletions(func(cs []transport.Completion, err error) {
			if err == nil {
				answer(cs)
			}
		})
		left := b.N
		ha.HandleCompletions(func(cs []transport.Completion, err error) {
			if err != nil {
				return
			}
			for _, c := range cs {
				if c.Status != transport.StatusSuccess {
					report(c.Err())
					return
				}
				if c.Op != transport.OpRecv {
					continue
				}
				if left--; left == 0 {
					close(done)
					return
				}
				if err := a.PostRecv(recvA...); err != nil {
					report(err)
				}
				if err := a.PostSend(ping...); err != nil {
					report(err)
				}
			}
		})
		if err := a.PostSend(ping...); err != nil {
			b.Fatal(err)
		}
		select {
		case <-done:
		case err := <-fail:
			b.Fatal(err)
		}
		b.StopTimer()
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	peerDone := make(chan struct{})
	go func() {
		defer close(peerDone)
		out := make([]transport.Completion, 16)
		for {
			n, err := p.Poll(ctx, out)
			if err != nil {
				return
			}
			answer(out[:n])
		}
	}()
	out := make([]transport.Completion, 16)
	for range b.N {
		if err := a.PostSend(ping...); err != nil {
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
				if c.Op == transport.OpRecv {
					got = true
					if err := a.PostRecv(recvA...); err != nil {
						b.Fatal(err)
					}
				}
			}
		}
	}
	b.StopTimer()
	select {
	case err := <-fail:
		b.Fatal(err)
	default:
	}
	cancel()
	<-peerDone
}

func benchRead4K(b *testing.B, network string, useHandler bool) {
	const size = 4096
	a, _, ra, rp := latencyPair(b, network, size)
	wrs := []transport.WorkRequest{{ID: 1, Op: transport.OpRead, Local: transport.SGE{Region: ra, Length: size}, RemoteAddr: rp.Addr(), RKey: rp.RKey()}}
	b.SetBytes(size)
	b.ReportAllocs()
	b.ResetTimer()
	defer reportCPU(b, cpuTime())
	if useHandler {
		ha := handler(b, a)
		done := make(chan error, 1)
		left := b.N
		ha.HandleCompletions(func(cs []transport.Completion, err error) {
			if err != nil {
				return
			}
			for _, c := range cs {
				if c.Status != transport.StatusSuccess {
					done <- c.Err()
					return
				}
				if left--; left == 0 {
					done <- nil
					return
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
	out := make([]transport.Completion, 1)
	for range b.N {
		if err := a.PostSend(wrs...); err != nil {
			b.Fatal(err)
		}
		if _, err := a.Poll(ctx, out); err != nil {
			b.Fatal(err)
		}
		if out[0].Status != transport.StatusSuccess {
			b.Fatal(out[0].Err())
		}
	}
	b.StopTimer()
}
