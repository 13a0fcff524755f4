package target_test

import (
	"bytes"
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/target"
)

// heldWrites is a store whose first write blocks until released: a disk
// that takes as long as the test wants.
type heldWrites struct {
	target.Store
	once     sync.Once
	entered  chan struct{}
	released chan struct{}
}

func (h *heldWrites) WriteAt(p []byte, off int64) (int, error) {
	h.once.Do(func() {
		close(h.entered)
		<-h.released
	})
	return h.Store.WriteAt(p, off)
}

// TestCloseWaitsForAFlushOnASlowDisk: an initiator that answers the
// shutdown notice with a Flush is waiting for the target, not stuck: while
// the target is still serving that Flush (its write-back on a slow disk
// takes many DrainTimeouts), the drain goes on, and the Flush succeeds.
// (Before, a drain counted only requests finished and writes completed as
// progress: one long write-back, 16 MiB of dirty chunks on a disk writing
// 1 MiB/s in the guest's e2e SIGTERM test, made it close the sessions
// after DrainTimeout, and the initiator's Flush failed with the link down:
// an EIO after a planned restart that lost nothing.)
func TestCloseWaitsForAFlushOnASlowDisk(t *testing.T) {
	const drainTimeout = time.Second
	disk := &heldWrites{entered: make(chan struct{}), released: make(chan struct{})}
	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10,
		DrainTimeout: drainTimeout, WritebackDelay: time.Hour,
		WrapStore: func(_ string, f *os.File) target.Store { disk.Store = f; return disk }}, target.ExportConfig{})
	c, notices, err := e.openNotified("host-a", "vol")
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("flushed during the drain "), 100)
	if err := c.writeChunk(t, 4096, data, c.info.Generation); err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() { closed <- e.tg.Close() }()
	select {
	case em := <-notices:
		if em.Code != protocol.CodeShutdown {
			t.Fatalf("notice %+v, want CodeShutdown", em)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no shutdown notice")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	flushed := make(chan error, 1)
	go func() {
		flushed <- c.Request(ctx, &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}, &protocol.OK{})
	}()
	select {
	case <-disk.entered:
	case <-ctx.Done():
		t.Fatal("the flush did not start writing back")
	}
	// The disk holds the write for three DrainTimeouts: the session must
	// outlive them (what is observed is the absence of its end, so this
	// waits for a while; nothing else tells that the drain is still
	// waiting).
	select {
	case <-c.Done():
		close(disk.released)
		t.Fatalf("the target closed the session while it was serving its flush: %v", c.Err())
	case <-time.After(3 * drainTimeout):
	}
	close(disk.released)
	if err := <-flushed; err != nil {
		t.Fatalf("flush during the drain: %v", err)
	}
	c.Close()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("Close did not return once the session left")
	}
	if got := readFile(t, e.path)[4096:][:len(data)]; !bytes.Equal(got, data) {
		t.Fatalf("file holds %q, want %q", got, data)
	}
}
