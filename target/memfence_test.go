package target_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/transporttest"
)

// Memory fencing: a grant's rkey reaches the cache only from the session
// it was granted to, and only until it is revoked, its handle closed, its
// session detached or taken over. Each case tries the stale rkey with an
// RDMA WRITE, wants it refused, and checks through a fresh grant that the
// memory it aimed at still holds what it held: the bytes are the proof,
// the error only says the write did not complete.

const fenceChunk = 64 << 10

func fenceContent() []byte { return bytes.Clone(fenceBytes()) }

// fenceBytes is made once: a test checks many chunks against it (built
// with -race and emulated, made a byte at a time per call, it was most of
// TestRKeyBeyondItsChunk's minute).
var fenceBytes = sync.OnceValue(func() []byte {
	b := make([]byte, 32*fenceChunk)
	rand.NewChaCha8([32]byte{7, 7}).Read(b)
	return b
})

// grantOf asks c for a write grant of the chunk at off.
func grantOf(t *testing.T, c *client, off uint64, write bool) protocol.Grant {
	t.Helper()
	var g protocol.Grant
	req := &protocol.GrantRequest{Handle: c.info.Handle, Offset: off}
	if write {
		req.Flags = protocol.GrantWrite
	}
	if err := c.Request(context.Background(), req, &g); err != nil {
		t.Fatal(err)
	}
	return g
}

// staleWriteFails does an RDMA WRITE through g on c and wants it refused
// by the target's memory checks.
func staleWriteFails(t *testing.T, c *client, g protocol.Grant, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := c.rdma(ctx, true, g, 0, bytes.Repeat([]byte("STALE!"), 100))
	if !transporttest.Refused(err) {
		t.Fatalf("RDMA WRITE with the rkey %s: %v, want a remote access error", what, err)
	}
}

// chunkHolds reads the chunk at off through a fresh session and grant and
// compares it with want.
func chunkHolds(t *testing.T, e *env, off uint64, want []byte) {
	t.Helper()
	c, err := e.openAs("checker", nil, protocol.ModeReadOnly, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	g := grantOf(t, c, off, false)
	got := make([]byte, len(want))
	if err := c.rdma(context.Background(), false, g, off-g.Offset, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("the chunk at %d changed: starts %q, want %q", off, got[:12], want[:12])
	}
}

func fenceEnv(t *testing.T, shared bool) *env {
	e, _ := startWith(t, fenceContent(), target.Options{CacheSize: 1 << 20, ChunkSize: fenceChunk}, target.ExportConfig{Shared: shared})
	return e
}

func TestRKeyAfterClose(t *testing.T) {
	e := fenceEnv(t, true)
	c, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	g := grantOf(t, c, 0, true)
	// Written without a Done: Close must still leave cache and file alike.
	if err := c.rdma(context.Background(), true, g, 0, []byte("before close")); err != nil {
		t.Fatal(err)
	}
	if err := c.Request(context.Background(), &protocol.Close{Handle: c.info.Handle}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	staleWriteFails(t, c, g, "of a closed handle")
	want := append([]byte("before close"), fenceContent()[12:fenceChunk]...)
	chunkHolds(t, e, 0, want)
	if err := e.tg.Close(); err != nil {
		t.Fatal(err)
	}
	if file := readFile(t, e.path); !bytes.Equal(file[:fenceChunk], want) {
		t.Fatal("the file differs from the cache after Close: a write without a Done was lost")
	}
}

func TestRKeyAfterRevoke(t *testing.T) {
	e := fenceEnv(t, true)
	c, err := e.dialAs("host-a", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	g := grantOf(t, c, 0, true)
	// Use more chunks than the cache holds: the oldest, chunk 0, goes.
	for i := uint64(1); ; i++ {
		grantOf(t, c, i%32*fenceChunk, false)
		select {
		case off := <-c.revoked:
			if off != 0 {
				continue
			}
		default:
			if i > 1000 {
				t.Fatal("chunk 0 was never revoked")
			}
			continue
		}
		break
	}
	staleWriteFails(t, c, g, "after its revoke")
	chunkHolds(t, e, 0, fenceContent()[:fenceChunk])
}

// TestRKeyOfAnotherSession: a live session's rkey does not work from
// another session, nor after its session detached.
func TestRKeyOfAnotherSession(t *testing.T) {
	e := fenceEnv(t, true)
	a, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	g := grantOf(t, a, 0, true)
	thief, err := e.openAs("host-b", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	staleWriteFails(t, thief, g, "of another, live session")
	a.Close() // detach
	waitDown(t, a.Link, "detached session")
	late, err := e.openAs("host-c", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	staleWriteFails(t, late, g, "of a detached session")
	chunkHolds(t, e, 0, fenceContent()[:fenceChunk])
}

func TestRKeyAfterTakeover(t *testing.T) {
	e := fenceEnv(t, false)
	a, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	g := grantOf(t, a, 0, true)
	b, err := e.openAs("host-b", nil, protocol.ModeReadWrite, protocol.OpenTakeover)
	if err != nil {
		t.Fatal(err)
	}
	waitDown(t, a.Link, "the old holder")
	staleWriteFails(t, b, g, "of the holder taken over")
	chunkHolds(t, e, 0, fenceContent()[:fenceChunk])
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRKeyBeyondItsChunk: a grant reaches its chunk and nothing around it
// (the cache's other slots sit right before and after it), also on a
// device that checks a window's operations against its region only.
func TestRKeyBeyondItsChunk(t *testing.T) {
	e := fenceEnv(t, true)
	const slots = 1 << 20 / fenceChunk // fenceEnv's cache
	for _, c := range []struct {
		name string
		off  func(g protocol.Grant) uint64
	}{
		{"after its end", func(g protocol.Grant) uint64 { return uint64(g.Length) }},
		{"before its start", func(g protocol.Grant) uint64 { return ^uint64(4096) + 1 }}, // -4096
	} {
		t.Run(c.name, func(t *testing.T) {
			a, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
			if err != nil {
				t.Fatal(err)
			}
			// Fill every slot of the cache, so that whatever sits around
			// chunk 1's slot is a chunk whose bytes are checked below.
			for i := uint64(0); i < slots; i++ {
				grantOf(t, a, i*fenceChunk, true)
			}
			g := grantOf(t, a, fenceChunk, true)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err = a.rdma(ctx, true, g, c.off(g), []byte("BEYOND"))
			if !transporttest.Refused(err) {
				t.Fatalf("RDMA WRITE %s: %v, want a remote access error", c.name, err)
			}
		})
	}
	for i := uint64(0); i < slots; i++ {
		chunkHolds(t, e, i*fenceChunk, fenceContent()[i*fenceChunk:(i+1)*fenceChunk])
	}
}
