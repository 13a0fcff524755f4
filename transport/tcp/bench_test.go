package tcp_test

import (
	"context"
	"testing"

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

// benchOneSided keeps depth requests of op and size bytes in flight.
func benchOneSided(b *testing.B, op transport.Opcode, size, depth int) {
	a, _, ra, rp := benchPair(b, size*depth)
	wrs := make([]transport.WorkRequest, 1) // reused: no allocation per post
	out := make([]transport.Completion, 64)
	ctx := context.Background()
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
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
