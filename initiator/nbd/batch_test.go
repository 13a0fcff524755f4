package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rblk/rblk/initiator/blockdev"
)

// batchBackend is a memBackend that is a blockdev.Submitter whose requests
// end in batches, as rblk's end per poll of a completion queue: SubmitRead
// and SubmitWrite do the IO at once and hold the request's end until
// complete, which ends the first n held ones in one pass (CompleteBatched
// for each, then Flush on each Flusher, once).
type batchBackend struct {
	*memBackend
	mu   sync.Mutex
	cond sync.Cond
	held []heldEnd

	// complete's, reused so that it allocates nothing.
	ends     []heldEnd
	flushers []blockdev.Flusher
}

type heldEnd struct {
	c   blockdev.Completion
	err error
}

func newBatchBackend(m *memBackend) *batchBackend {
	b := &batchBackend{memBackend: m}
	b.cond.L = &b.mu
	return b
}

// export is rwExport's, served by b.
func (b *batchBackend) export() *Export {
	x := rwExport("vol", b.memBackend)
	x.Backend = b
	return x
}

func (b *batchBackend) SubmitRead(ctx context.Context, buf *Buffer, off uint64, c blockdev.Completion) {
	b.hold(c, b.ReadAt(ctx, buf, off))
}

func (b *batchBackend) SubmitWrite(ctx context.Context, buf *Buffer, off uint64, fua bool, c blockdev.Completion) {
	b.hold(c, b.WriteAt(ctx, buf, off, fua))
}

func (b *batchBackend) hold(c blockdev.Completion, err error) {
	b.mu.Lock()
	b.held = append(b.held, heldEnd{c, err})
	b.cond.Broadcast()
	b.mu.Unlock()
}

// complete waits until n requests are held and ends them in one pass.
func (b *batchBackend) complete(t *testing.T, n int) {
	t.Helper()
	b.mu.Lock()
	for len(b.held) < n {
		b.cond.Wait()
	}
	b.ends = append(b.ends[:0], b.held[:n]...)
	k := copy(b.held, b.held[n:])
	clear(b.held[k:])
	b.held = b.held[:k]
	b.mu.Unlock()
	flushers := b.flushers[:0]
	for _, e := range b.ends {
		bc, ok := e.c.(blockdev.BatchCompletion)
		if !ok {
			t.Fatalf("%T is not a blockdev.BatchCompletion", e.c)
		}
		f := bc.CompleteBatched(e.err)
		if f == nil {
			continue
		}
		seen := false
		for _, g := range flushers {
			seen = seen || g == f
		}
		if !seen {
			flushers = append(flushers, f)
		}
	}
	if len(flushers) != 1 {
		t.Errorf("%d flushers for the requests of one connection, want 1", len(flushers))
	}
	for _, f := range flushers {
		f.Flush()
	}
	clear(b.ends)
	clear(flushers)
	b.flushers = flushers[:0]
}

// TestBatchedReplies: the replies of requests that end in one pass go out
// together once flushed: 24 WRITEs and 24 READs, 72 segments of replies,
// in two writevs (64 segments at most each), every reply and its data
// right.
func TestBatchedReplies(t *testing.T) {
	const size, n, length = 1 << 20, 24, 512
	be := newBatchBackend(newMemBackend(size, 4096, 64))
	m := NewMetrics(nil)
	ts := startServer(t, Options{Exports: []*Export{be.export()}, Metrics: m})
	rc := dialGo(t, ts.sock, "vol")
	want := initial(size)
	for i := range n {
		payload := bytes.Repeat([]byte{byte(i + 1)}, length)
		off := uint64(i) * 2 * length
		copy(want[off:], payload)
		rc.request(cmdWrite, 0, uint64(i), off, length, payload)
	}
	for i := range n {
		rc.request(cmdRead, 0, uint64(n+i), uint64(i)*2*length+length, length, nil)
	}
	before := testutil.ToFloat64(m.replyWrites)
	be.complete(t, 2*n)
	got := make(map[uint64]bool)
	for range 2 * n {
		errno, cookie := rc.reply()
		if errno != 0 || cookie >= 2*n || got[cookie] {
			t.Fatalf("reply errno %d cookie %d (seen: %v)", errno, cookie, got[cookie])
		}
		got[cookie] = true
		if cookie >= n {
			off := (cookie-n)*2*length + length
			if data := rc.read(length); !bytes.Equal(data, want[off:off+length]) {
				t.Fatalf("data of the READ at %d", off)
			}
		}
	}
	if w := testutil.ToFloat64(m.replyWrites) - before; w != 2 {
		t.Errorf("%v writes for the replies of one batch of %d requests, want 2", w, 2*n)
	}
	checkBytes(t, be.snapshot(), want)
}

// TestBatchedRepliesSocketFull: a batch larger than the socket takes goes
// in part at once and the rest through the writer goroutine, in order:
// 48 READs of 128 KiB (6 MiB) end in one pass while the client reads
// nothing, then it reads every reply whole and right.
func TestBatchedRepliesSocketFull(t *testing.T) {
	const size, n, length = 8 << 20, 48, 128 << 10
	be := newBatchBackend(newMemBackend(size, 48<<10, 3*n))
	ts := startServer(t, Options{Exports: []*Export{be.export()}})
	rc := dialGo(t, ts.sock, "vol")
	for i := range n {
		rc.request(cmdRead, 0, uint64(i), uint64(i)*length+uint64(i), length, nil)
	}
	be.complete(t, n)
	want := initial(size)
	got := make(map[uint64]bool)
	for range n {
		errno, cookie := rc.reply()
		if errno != 0 || cookie >= n || got[cookie] {
			t.Fatalf("reply errno %d cookie %d (seen: %v)", errno, cookie, got[cookie])
		}
		got[cookie] = true
		off := cookie*length + cookie
		if data := rc.read(length); !bytes.Equal(data, want[off:off+length]) {
			t.Fatalf("data of the READ of cookie %d", cookie)
		}
	}
}

// TestBatchedReplyAllocs: a request that ends in a batch allocates
// nothing once the pools are warm.
func TestBatchedReplyAllocs(t *testing.T) {
	be := newBatchBackend(newMemBackend(1<<20, 4096, 64))
	ts := startServer(t, Options{Exports: []*Export{be.export()}})
	rc := dialGo(t, ts.sock, "vol")
	req := make([]byte, 4*requestSize)
	rep := make([]byte, 4*replySize+2*4096)
	round := func() {
		for i := range 4 {
			b := req[i*requestSize:]
			binary.BigEndian.PutUint32(b[0:], magicRequest)
			binary.BigEndian.PutUint16(b[6:], cmdRead)
			binary.BigEndian.PutUint64(b[8:], uint64(i))
			binary.BigEndian.PutUint32(b[24:], 1024)
		}
		if _, err := rc.c.Write(req); err != nil {
			t.Fatal(err)
		}
		be.complete(t, 4)
		if _, err := rc.c.Read(rep[:1]); err != nil {
			t.Fatal(err)
		}
		for left := 4*(replySize+1024) - 1; left > 0; {
			k, err := rc.c.Read(rep[:min(left, len(rep))])
			if err != nil {
				t.Fatal(err)
			}
			left -= k
		}
	}
	for range 200 {
		round()
	}
	if per := testing.AllocsPerRun(200, round); per > 0.5 {
		t.Errorf("%.2f allocations per round of 4 batched requests", per)
	}
}

// TestBatchedRepliesClientGone: a client that sent writes and reads and
// stopped reading its socket (shutdown SHUT_RD: the server's writes fail
// with EPIPE, its reads go on) before they ended: the batch's writev
// fails, its requests end all the same (their writes are in the backend,
// every buffer goes back), that connection ends, and the server serves the
// next client.
func TestBatchedRepliesClientGone(t *testing.T) {
	const n, length = 16, 4096
	be := newBatchBackend(newMemBackend(1<<20, 4096, 64))
	m := NewMetrics(nil)
	ts := startServer(t, Options{Exports: []*Export{be.export()}, Metrics: m})
	rc := dialGo(t, ts.sock, "vol")
	want := initial(1 << 20)
	for i := range n {
		payload := bytes.Repeat([]byte{byte(i + 1)}, length)
		copy(want[i*length:], payload)
		rc.request(cmdWrite, 0, uint64(i), uint64(i)*length, length, payload)
		rc.request(cmdRead, 0, uint64(n+i), uint64(n+i)*length, length, nil)
	}
	be.mu.Lock()
	for len(be.held) < 2*n {
		be.cond.Wait()
	}
	be.mu.Unlock()
	if err := rc.c.(*net.UnixConn).CloseRead(); err != nil {
		t.Fatal(err)
	}
	be.complete(t, 2*n)
	waitFor(t, "the connection to end", func() bool { return testutil.ToFloat64(m.connections) == 0 })
	checkBytes(t, be.snapshot(), want)
	be.checkReturned(t)

	rc2 := dialGo(t, ts.sock, "vol")
	rc2.request(cmdRead, 0, 7, 0, length, nil)
	be.complete(t, 1)
	if errno, cookie := rc2.reply(); errno != 0 || cookie != 7 {
		t.Fatalf("next client: errno %d cookie %d", errno, cookie)
	}
	if !bytes.Equal(rc2.read(length), want[:length]) {
		t.Fatal("next client: data")
	}
}
