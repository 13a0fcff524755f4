package initiator_test

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/blockdev"
)

// TestQueuePlug: requests submitted to a plugged queue start together at
// Unplug, with one post to the target's connection, and complete with
// their data in place; unplugged, each posts its own.
func TestQueuePlug(t *testing.T) {
	const size, chunk, n = 4 << 20, 1 << 20, 8
	r := startTarget(t, size, 8<<20, chunk, false)
	ireg := prometheus.NewRegistry()
	v := r.openWith(initiator.Options{HostID: "host-plug", Queues: 1, Metrics: initiator.NewMetrics(ireg)})
	q := v.Queue(0)
	sub, ok := q.(blockdev.Submitter)
	if !ok {
		t.Fatalf("queue %T is not a blockdev.Submitter", q)
	}
	pl, ok := q.(blockdev.Plugger)
	if !ok {
		t.Fatalf("queue %T is not a blockdev.Plugger", q)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	bufs := make([]*blockdev.Buffer, n)
	for i := range bufs {
		b, err := q.Alloc(ctx, 4096)
		if err != nil {
			t.Fatal(err)
		}
		defer q.Free(b)
		bufs[i] = b
	}
	off := func(i int) uint64 { return uint64(i%4)*chunk + uint64(i)*8192 }
	wait := func(what string, cs []chanCompletion) {
		t.Helper()
		for i, c := range cs {
			select {
			case err := <-c:
				if err != nil {
					t.Fatalf("%s %d: %v", what, i, err)
				}
			case <-ctx.Done():
				t.Fatalf("%s %d did not complete", what, i)
			}
		}
	}
	// Every chunk granted first: the requests below all go the
	// run-to-completion way.
	for i := range 4 {
		c := make(chanCompletion, 1)
		sub.SubmitRead(ctx, bufs[0], uint64(i)*chunk, c)
		wait("warm-up read", []chanCompletion{c})
	}

	// As many writes as a queue keeps Dones in flight, so that each
	// chains its own (no Done batch goes later from a callback). A
	// keepalive or credit message may add a post: at most 2 where
	// unplugged writes make one each.
	const nw = 4
	want := make([][]byte, n)
	dones := make([]chanCompletion, n)
	for i := range dones {
		dones[i] = make(chanCompletion, 1)
	}
	before := metric(t, ireg, "rblk_attach_sq_posts_total")
	pl.Plug()
	for i := range nw {
		want[i] = bytes.Repeat([]byte{byte(0x40 + i)}, 4096)
		copy(bufs[i].Segs[0], want[i])
		sub.SubmitWrite(ctx, bufs[i], off(i), false, dones[i])
	}
	if got := metric(t, ireg, "rblk_attach_sq_posts_total") - before; got != 0 {
		t.Fatalf("plugged: %v posts, want 0", got)
	}
	for i, c := range dones[:nw] {
		select {
		case err := <-c:
			t.Fatalf("write %d completed while plugged: %v", i, err)
		default:
		}
	}
	pl.Unplug()
	wait("plugged write", dones[:nw])
	if got := metric(t, ireg, "rblk_attach_sq_posts_total") - before; got < 1 || got > 2 {
		t.Fatalf("Unplug of %d writes: %v posts, want 1", nw, got)
	}
	if err := v.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	for i := range nw {
		if o := off(i); !bytes.Equal(file[o:o+4096], want[i]) {
			t.Fatalf("write %d at %d is not in the file after a flush", i, o)
		}
	}

	// Reads, plugged, then unplugged: one post, then one each.
	for i := nw; i < n; i++ {
		want[i] = file[off(i) : off(i)+4096]
	}
	before = metric(t, ireg, "rblk_attach_sq_posts_total")
	pl.Plug()
	for i := range n {
		clear(bufs[i].Segs[0])
		sub.SubmitRead(ctx, bufs[i], off(i), dones[i])
	}
	pl.Unplug()
	wait("plugged read", dones)
	if got := metric(t, ireg, "rblk_attach_sq_posts_total") - before; got < 1 || got > 2 {
		t.Fatalf("Unplug of %d reads: %v posts, want 1", n, got)
	}
	for i := range n {
		if !bytes.Equal(bufs[i].Segs[0], want[i]) {
			t.Fatalf("read %d at %d: wrong data", i, off(i))
		}
	}
	before = metric(t, ireg, "rblk_attach_sq_posts_total")
	for i := range n {
		sub.SubmitRead(ctx, bufs[i], off(i), dones[i])
		wait("read", dones[i:i+1])
	}
	if got := metric(t, ireg, "rblk_attach_sq_posts_total") - before; got < n {
		t.Fatalf("%d reads unplugged: %v posts, want %d", n, got, n)
	}
}
