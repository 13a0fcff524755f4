package initiator_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

// heldWrites submits n 4 KiB writes on v while the completions of its
// connection are held (faultnet Hold), so that every write finds the
// window of Dones full but the first ones; then releases them (after
// between, if not nil) and waits for every write. Half the writes are
// contiguous (one range in a Done), half spread out. It returns the
// offsets and the data written.
func heldWrites(t *testing.T, v *initiator.Volume, c *faultnet.Conn, n int, between func()) ([]uint64, [][]byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	offs := make([]uint64, n)
	datas := make([][]byte, n)
	bufs := make([]*blockdev.Buffer, n)
	for i := range n {
		offs[i] = uint64(i) * 4096
		if i%2 == 1 {
			offs[i] = 1<<20 + uint64(i)*3*4096
		}
		datas[i] = bytes.Repeat([]byte{byte(i + 1)}, 4096)
		b, err := v.Alloc(ctx, 4096)
		if err != nil {
			t.Fatal(err)
		}
		copy(b.Segs[0], datas[i])
		bufs[i] = b
	}
	done := make(chanCompletion, n)
	c.Hold()
	for i := range n {
		v.SubmitWrite(ctx, bufs[i], offs[i], false, done)
	}
	if between != nil {
		between()
	}
	c.Release()
	for range n {
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("write: %v", err)
			}
		case <-ctx.Done():
			t.Fatal("writes did not complete")
		}
	}
	for _, b := range bufs {
		v.Free(b)
	}
	return offs, datas
}

// checkWritten reads the writes back through v, then, flushed, from the
// backing file.
func checkWritten(t *testing.T, r *rig, v *initiator.Volume, offs []uint64, datas [][]byte) {
	t.Helper()
	for i, off := range offs {
		got, err := read(t, v, off, len(datas[i]))
		if err != nil || !bytes.Equal(got, datas[i]) {
			t.Fatalf("read back at %d: %v (equal %v)", off, err, bytes.Equal(got, datas[i]))
		}
	}
	if err := v.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	for i, off := range offs {
		if got := file[off : off+uint64(len(datas[i]))]; !bytes.Equal(got, datas[i]) {
			t.Fatalf("backing file at %d: %#x..., want %#x...", off, got[:4], datas[i][:4])
		}
	}
}

// TestWritesShareDones: writes submitted while the queue's window of Dones
// is in flight wait for one Done that reports them all, in as few ranges
// as they are contiguous; their data is in the volume and, flushed, in its
// file.
func TestWritesShareDones(t *testing.T) {
	r := startTarget(t, 4<<20, 4<<20, 1<<20, false)
	fn := faultnet.Wrap(r.p)
	reg := prometheus.NewRegistry()
	v := r.openWith(initiator.Options{Provider: fn, Queues: 1, Metrics: initiator.NewMetrics(reg)})
	for off := uint64(0); off < 4<<20; off += 1 << 20 {
		if err := write(t, v, off, []byte("grant"), false); err != nil { // the chunks' write grants
			t.Fatal(err)
		}
	}
	const n = 64
	msgs, writes := metric(t, reg, "rblk_attach_done_messages_total"), metric(t, reg, "rblk_attach_done_writes_total")
	offs, datas := heldWrites(t, v, fn.Conns()[0], n, func() {
		// Held: the window's Dones are out, the rest wait for them.
		if got := metric(t, reg, "rblk_attach_done_messages_total") - msgs; got != initiator.DoneWindow {
			t.Errorf("%v Dones sent with the completions held, want the window's %d", got, initiator.DoneWindow)
		}
	})
	// The window's Dones, one each, and then one for all the others.
	if got := metric(t, reg, "rblk_attach_done_messages_total") - msgs; got != initiator.DoneWindow+1 {
		t.Errorf("%v Dones for %d writes, want %d", got, n, initiator.DoneWindow+1)
	}
	if got := metric(t, reg, "rblk_attach_done_writes_total") - writes; got != n {
		t.Errorf("the Dones reported %v writes, want %d", got, n)
	}
	checkWritten(t, r, v, offs, datas)
}

// TestHeldWritesLostConnection: writes waiting for their Done when the
// connection breaks are done again over the next one; none is lost.
func TestHeldWritesLostConnection(t *testing.T) {
	r := startTarget(t, 4<<20, 4<<20, 1<<20, false)
	fn := faultnet.Wrap(r.p)
	v := r.openWith(initiator.Options{Provider: fn, Queues: 1, ReconnectTimeout: 20 * time.Second})
	for off := uint64(0); off < 4<<20; off += 1 << 20 {
		if err := write(t, v, off, []byte("grant"), false); err != nil {
			t.Fatal(err)
		}
	}
	c := fn.Conns()[0]
	offs, datas := heldWrites(t, v, c, 64, c.Disconnect)
	if !c.Disconnected() {
		t.Fatal("the connection was not broken")
	}
	// The writes acknowledged were done again on the new connection: the
	// flush that follows a lost connection reports lost writes only for
	// those acknowledged before it broke.
	if err := v.Flush(context.Background()); err != nil && !errors.Is(err, initiator.ErrLostWrites) {
		t.Fatalf("flush: %v", err)
	}
	checkWritten(t, r, v, offs, datas)
}

// TestDonePostedWhenLinkWouldWait: a Done batch that the completion path
// cannot post without waiting (no send slot or credit free: forced here)
// is posted by a goroutine of its own; its writes complete and their data
// is in the volume and the file.
func TestDonePostedWhenLinkWouldWait(t *testing.T) {
	r := startTarget(t, 4<<20, 4<<20, 1<<20, false)
	fn := faultnet.Wrap(r.p)
	v := r.openWith(initiator.Options{Provider: fn, Queues: 1})
	for off := uint64(0); off < 4<<20; off += 1 << 20 {
		if err := write(t, v, off, []byte("grant"), false); err != nil {
			t.Fatal(err)
		}
	}
	var forced atomic.Int64
	initiator.SetTestHookWouldWait(func() bool { forced.Add(1); return true })
	defer initiator.SetTestHookWouldWait(nil)
	offs, datas := heldWrites(t, v, fn.Conns()[0], 64, nil)
	if forced.Load() == 0 {
		t.Fatal("no Done batch was posted from the completion path")
	}
	checkWritten(t, r, v, offs, datas)
}
