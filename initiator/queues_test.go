package initiator_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

// TestQueuesFlushEveryQueue: a flush covers the writes completed on every
// queue. The target's receive path of the second queue is slowed (its
// Dones arrive late); a write that went there has completed, so the Flush
// that follows must not return before its Done has reached the target:
// the file holds it. (A flush on the first queue alone returns first.)
func TestQueuesFlushEveryQueue(t *testing.T) {
	tp, laddr := testProvider(t)
	tn := faultnet.Wrap(tp)
	const chunk = 64 << 10
	r := startTargetOn(t, tn, filepath.Join(t.TempDir(), "vol.img"), laddr, 1<<20, 1<<20, chunk, false)
	ireg := prometheus.NewRegistry()
	ip, _ := testProvider(t)
	v := r.openWith(initiator.Options{Provider: ip, HostID: "host-q", Queues: 2, Metrics: initiator.NewMetrics(ireg)})
	if got := metric(t, r.reg, "rblkd_sessions"); got != 2 {
		t.Fatalf("target sessions with 2 queues: %v, want 2", got)
	}
	// Chunk 0 goes to the first queue, chunk 1 to the second.
	for _, off := range []uint64{0, chunk} {
		if err := write(t, v, off, []byte("warm"), false); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	if err := v.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	conns := tn.Conns() // accepted, in order: the first queue, the second
	if len(conns) != 2 {
		t.Fatalf("%d connections, want 2", len(conns))
	}
	conns[1].Delay(300 * time.Millisecond)
	data := bytes.Repeat([]byte("queue-1 "), 512)
	if err := write(t, v, chunk+4096, data, false); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file[chunk+4096:chunk+4096+len(data)], data) {
		t.Fatal("a write completed on the second queue is not in the file after FLUSH returned OK")
	}
	conns[1].Delay(0)
}

// TestQueuesReconnectAndFence: a volume of 3 queues spreads its chunks
// over them; when one connection breaks, all are made again and the data
// is intact; when another attach of the same host takes the export over,
// every queue of the first attach is fenced (it fails with ErrFenced, and
// the target is left with the second's connections only).
func TestQueuesReconnectAndFence(t *testing.T) {
	const chunk, size = 64 << 10, 1 << 20
	r := startTarget(t, size, size, chunk, false)
	in := faultnet.Wrap(r.p)
	ireg := prometheus.NewRegistry()
	v := r.openWith(initiator.Options{Provider: in, HostID: "host-q", Queues: 3, ReconnectTimeout: 20 * time.Second,
		Metrics: initiator.NewMetrics(ireg)})
	if got := metric(t, r.reg, "rblkd_sessions"); got != 3 {
		t.Fatalf("target sessions with 3 queues: %v, want 3", got)
	}
	model := make([]byte, size)
	rng := rand.New(rand.NewPCG(1, 2))
	writeAll := func() {
		t.Helper()
		for off := 0; off < size; off += chunk {
			b := make([]byte, 8192)
			for i := range b {
				b[i] = byte(rng.Uint32())
			}
			at := off + int(rng.IntN(chunk-len(b))&^511)
			copy(model[at:], b)
			if err := write(t, v, uint64(at), b, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	writeAll()
	if got := metric(t, ireg, "rblk_attach_grants_held"); got != size/chunk {
		t.Fatalf("grants held: %v, want one per chunk (%d): a chunk is granted on one queue only", got, size/chunk)
	}
	ctx := context.Background()
	if err := v.Flush(ctx); err != nil {
		t.Fatal(err)
	}

	in.Conns()[2].Disconnect() // the third queue's cable
	waitFor(t, "the reconnect", func() bool { return metric(t, ireg, "rblk_attach_reconnects_total") >= 1 })
	writeAll()
	got, err := read(t, v, 0, size)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model) {
		t.Fatal("read after the reconnect differs from what was written")
	}
	if err := v.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the old queues' end on the target", func() bool { return metric(t, r.reg, "rblkd_sessions") == 3 })

	second := r.openWith(initiator.Options{HostID: "host-q", Queues: 2, Takeover: true})
	select {
	case <-v.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the first attach is still up after another attach of its host took the export over")
	}
	if err := v.Err(); !errors.Is(err, initiator.ErrFenced) {
		t.Fatalf("first attach ended with %v, want ErrFenced", err)
	}
	waitFor(t, "the fenced queues' end on the target", func() bool { return metric(t, r.reg, "rblkd_sessions") == 2 })
	got, err = read(t, second, 0, size)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, model) {
		t.Fatal("the second attach reads other bytes than the first wrote")
	}
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file, model) {
		t.Fatal("the file differs from what was written and flushed")
	}
}

// TestQueueRoutesToItsConnection: the backend of queue i (what the NBD
// server gives its i-th connection) sends its requests on connection i,
// whatever chunk they touch: a write of chunk 0 through queue 1 goes out
// on the second connection (armed to lose its next SEND), through queue 0
// on the first.
func TestQueueRoutesToItsConnection(t *testing.T) {
	const chunk = 64 << 10
	r := startTarget(t, 1<<20, 1<<20, chunk, false)
	in := faultnet.Wrap(r.p)
	v := r.openWith(initiator.Options{Provider: in, HostID: "host-q", Queues: 2, ReconnectTimeout: 20 * time.Second})
	conns := in.Conns()
	if len(conns) != 2 {
		t.Fatalf("%d connections, want 2", len(conns))
	}
	for i := range 2 { // grants in place on both queues
		if err := write(t, v.Queue(i), 0, []byte("warm"), false); err != nil {
			t.Fatal(err)
		}
	}
	conns[1].LoseNextSend()
	if err := write(t, v.Queue(0), 0, []byte("queue 0"), false); err != nil {
		t.Fatal(err)
	}
	if err := write(t, v.Queue(2), 4096, []byte("queue 2 is queue 0"), false); err != nil {
		t.Fatal(err)
	}
	if conns[1].Disconnected() {
		t.Fatal("a request of queue 0 went out on the second connection")
	}
	if err := write(t, v.Queue(1), 0, []byte("queue 1"), false); err != nil {
		t.Fatal(err) // (done again after the reconnect)
	}
	if !conns[1].Disconnected() {
		t.Fatal("a request of queue 1 did not go out on the second connection")
	}
	if err := v.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, err := read(t, v, 0, 7)
	if err != nil || string(got) != "queue 1" {
		t.Fatalf("read back %q, %v; want the last write", got, err)
	}
}
