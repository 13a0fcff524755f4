package tcp

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
)

// TestInvalidateWaitsForWrite: a peer's WRITE through a window that is
// being placed when Invalidate is called holds the invalidation until the
// payload is in; a peer that stalls in the middle of the payload is cut off
// when Invalidate's ctx ends, and nothing more reaches the memory.
func TestInvalidateWaitsForWrite(t *testing.T) {
	l := listenTCP(t, Options{})
	p, c := dialRaw(t, l)
	mem, w := writableWindow(t, c, 1<<20, 0, 1<<20)
	// A WRITE of 256 KiB of which only the first half arrives: the reader
	// is in the middle of placing it (it reads large payloads straight
	// into the memory).
	const n = 256 << 10
	data := bytes.Repeat([]byte{0xab}, n)
	p.send(frameWrite, 0, n, 1, w.Addr(), w.RKey(), 0, data[:n/2])
	time.Sleep(100 * time.Millisecond)

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		done <- w.Invalidate(ctx)
	}()
	select {
	case err := <-done:
		t.Fatalf("invalidate returned (%v) while a WRITE was being placed", err)
	case <-time.After(100 * time.Millisecond):
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("invalidate after cutting the stalled peer off: %v, want nil", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("invalidate did not return once its ctx ended")
	}
	snapshot := bytes.Clone(mem.Bytes())
	// The rest of the payload finds the connection closed.
	p.nc.Write(data[n/2:])
	time.Sleep(50 * time.Millisecond)
	if !bytes.Equal(snapshot, mem.Bytes()) {
		t.Error("the memory changed after Invalidate returned")
	}
	if _, err := c.Poll(context.Background(), make([]transport.Completion, 1)); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("poll: %v, want ErrClosed", err)
	}
}

// TestInvalidateAfterWrite: once the WRITE's payload is placed, Invalidate
// returns at once and the connection stays up.
func TestInvalidateAfterWrite(t *testing.T) {
	l := listenTCP(t, Options{})
	p, c := dialRaw(t, l)
	mem, w := writableWindow(t, c, 1<<16, 4096, 4096)
	p.send(frameWrite, 0, 16, 1, w.Addr(), w.RKey(), 0, bytes.Repeat([]byte{1}, 16))
	if h, _ := p.next(); h.typ() != frameAck || h.seq() != 1 {
		t.Fatalf("got %v, want ACK 1", &h)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := w.Invalidate(ctx); err != nil {
		t.Fatal(err)
	}
	if live, _ := c.(*conn).WindowStats(); live != 0 {
		t.Errorf("%d windows live after the invalidation", live)
	}
	// A WRITE through the old key now is refused with a NAK.
	p.send(frameWrite, 0, 16, 2, w.Addr(), w.RKey(), 0, bytes.Repeat([]byte{2}, 16))
	if h, _ := p.next(); h.typ() != frameNak || h.seq() != 2 || transport.Status(h.status()) != transport.StatusRemoteAccessError {
		t.Fatalf("got %v status %d, want NAK 2 with a remote access error", &h, h.status())
	}
	if mem.Bytes()[4096] != 1 {
		t.Error("the refused WRITE changed the memory")
	}
}

// writableWindow registers size bytes on c and binds a remotely writable
// window over [off, off+length) of them.
func writableWindow(t *testing.T, c transport.Conn, size, off, length int) (*transport.Memory, transport.Window) {
	t.Helper()
	mem, err := transport.AllocMemory(size, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Free() })
	r, err := c.Register(mem.Bytes(), transport.AccessLocalWrite|transport.AccessBindWindow)
	if err != nil {
		t.Fatal(err)
	}
	w, err := c.(transport.WindowBinder).BindWindow(context.Background(), r, off, length, transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	return mem, w
}
