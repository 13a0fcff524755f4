package nbd

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/initiator/blockdev"
)

// plugBackend is a memBackend that is a blockdev.Submitter and a
// blockdev.Plugger as rblk's queues are: a request submitted while it is
// plugged is held back, and makes no progress, until Unplug, which starts
// (here: does and completes) all it held. It records how many requests
// each Unplug released.
type plugBackend struct {
	*memBackend
	mu       sync.Mutex
	plugged  bool
	held     []func()
	released []int // per Unplug that released any
	plugs    int
}

func (b *plugBackend) export() *Export {
	x := rwExport("vol", b.memBackend)
	x.Backend = b
	return x
}

func (b *plugBackend) Plug() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.plugged {
		panic("Plug while plugged")
	}
	b.plugged = true
	b.plugs++
}

func (b *plugBackend) Unplug() {
	b.mu.Lock()
	held := b.held
	b.held = nil
	b.plugged = false
	if len(held) > 0 {
		b.released = append(b.released, len(held))
	}
	b.mu.Unlock()
	for _, f := range held {
		f()
	}
}

func (b *plugBackend) start(f func()) {
	b.mu.Lock()
	if b.plugged {
		b.held = append(b.held, f)
		b.mu.Unlock()
		return
	}
	b.mu.Unlock()
	f()
}

func (b *plugBackend) SubmitRead(ctx context.Context, buf *Buffer, off uint64, c blockdev.Completion) {
	b.start(func() { c.Complete(b.ReadAt(ctx, buf, off)) })
}

func (b *plugBackend) SubmitWrite(ctx context.Context, buf *Buffer, off uint64, fua bool, c blockdev.Completion) {
	b.start(func() { c.Complete(b.WriteAt(ctx, buf, off, fua)) })
}

func (b *plugBackend) stats() (plugs int, released []int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.plugs, append([]int(nil), b.released...)
}

// readReplies reads n replies to READs of length bytes at cookie*stride
// (cookie < n) and checks their data against want.
func readReplies(t *testing.T, rc *rawClient, n int, length uint32, stride uint64, want []byte) {
	t.Helper()
	got := make(map[uint64]bool)
	for range n {
		errno, cookie := rc.reply()
		if errno != 0 || cookie >= uint64(n) || got[cookie] {
			t.Fatalf("reply errno %d cookie %d (seen: %v)", errno, cookie, got[cookie])
		}
		got[cookie] = true
		off := cookie * stride
		if data := rc.read(int(length)); !bytes.Equal(data, want[off:off+uint64(length)]) {
			t.Fatalf("data of the READ of cookie %d", cookie)
		}
	}
}

// TestPlugBatchesBufferedRequests: requests that arrive together (one
// write of the client, one read of the server) are submitted plugged and
// started together by one Unplug, before the reader waits for more; each
// is answered right.
func TestPlugBatchesBufferedRequests(t *testing.T) {
	const size, n, length = 1 << 20, 32, 512
	be := &plugBackend{memBackend: newMemBackend(size, 4096, 64)}
	ts := startServer(t, Options{Exports: []*Export{be.export()}})
	rc := dialGo(t, ts.sock, "vol")
	var req []byte
	for i := range n {
		req = append(req, requestBytes(cmdRead, 0, uint64(i), uint64(i)*length, length, nil)...)
	}
	rc.write(req)
	readReplies(t, rc, n, length, length, initial(size))
	plugs, released := be.stats()
	most := 0
	for _, k := range released {
		most = max(most, k)
	}
	if most < n/2 {
		t.Errorf("%d requests read together: %d plugs, released %v: want one Unplug to start at least %d", n, plugs, released, n/2)
	}

	// One request alone is not plugged.
	rc.write(requestBytes(cmdRead, 0, 0, 0, length, nil))
	readReplies(t, rc, 1, length, length, initial(size))
	if p, _ := be.stats(); p != plugs {
		t.Errorf("a request alone plugged the backend (%d plugs, before %d)", p, plugs)
	}
}

// TestPlugUnplugsBeforeWaiting: the reader unplugs before whatever may
// block it, since the requests it held back are what would unblock it:
// the slot of a request in flight (MaxInFlight), and the rest of a
// WRITE's payload that the client sends only once it has the reply of the
// READ before it. Without that both would wait forever.
func TestPlugUnplugsBeforeWaiting(t *testing.T) {
	const size, length = 1 << 20, 512
	be := &plugBackend{memBackend: newMemBackend(size, 4096, 64)}
	ts := startServer(t, Options{Exports: []*Export{be.export()}, MaxInFlight: 4})
	rc := dialGo(t, ts.sock, "vol")
	rc.deadline(10 * time.Second)
	want := initial(size)

	// 16 READs at once, 4 in flight at most.
	var req []byte
	for i := range 16 {
		req = append(req, requestBytes(cmdRead, 0, uint64(i), uint64(i)*length, length, nil)...)
	}
	rc.write(req)
	readReplies(t, rc, 16, length, length, want)

	// A READ, then a WRITE whose payload comes in two parts, the second
	// only after the READ's reply.
	payload := bytes.Repeat([]byte{0xa5}, 4096)
	w := requestBytes(cmdWrite, 0, 1, 64<<10, 4096, payload)
	rc.write(append(requestBytes(cmdRead, 0, 0, 0, length, nil), w[:requestSize+1000]...))
	readReplies(t, rc, 1, length, length, want)
	rc.write(w[requestSize+1000:])
	if errno, cookie := rc.reply(); errno != 0 || cookie != 1 {
		t.Fatalf("WRITE: reply errno %d cookie %d", errno, cookie)
	}
	copy(want[64<<10:], payload)
	checkBytes(t, be.snapshot(), want)
}
