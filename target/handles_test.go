package target_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/transporttest"
)

// Grants belong to handles: a grant carries the access of the handle it was
// made for, and dies with that handle's Close, not with another's; a
// session's queues, and all sessions of a host, are one share of the cache;
// and every holder has the whole revoke timeout to answer.

// recorder is a raw client that records every Revoke as it arrives, before
// it answers (after ackDelay: a slow initiator is the fault under test), so
// that once a grant that needed an eviction returns, the revoke it caused
// is recorded.
type recorder struct {
	*client
	mu      sync.Mutex
	revokes []protocol.Revoke
}

// dialRecorder connects as host and sends open (an Open or a Join).
func (e *env) dialRecorder(host string, ackDelay time.Duration, open protocol.Message) (*recorder, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r := &recorder{}
	ready := make(chan struct{})
	var l *link.Link
	l, err := link.Dial(ctx, e.p, e.addr, link.Options{Handler: func(h protocol.Header, p []byte) {
		<-ready
		var rv protocol.Revoke
		if h.Type != protocol.TypeRevoke || rv.Unmarshal(p) != nil {
			return
		}
		r.mu.Lock()
		r.revokes = append(r.revokes, rv)
		r.mu.Unlock()
		go func() {
			select {
			case <-time.After(ackDelay): // the initiator's own slowness under test
			case <-l.Done():
				return
			}
			l.Send(context.Background(), h.Tag, &protocol.RevokeAck{Handle: rv.Handle, Offset: rv.Offset, Generation: rv.Generation})
		}()
	}})
	if err != nil {
		return nil, err
	}
	close(ready)
	e.t.Cleanup(func() { l.Close() })
	r.client = &client{Link: l}
	if _, err := auth.Initiate(ctx, l, host, nil); err != nil {
		return nil, err
	}
	return r, l.Request(ctx, open, &r.info)
}

// revoked returns the offsets of the Revokes r got so far.
func (r *recorder) revoked() []uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []uint64
	for _, rv := range r.revokes {
		out = append(out, rv.Offset)
	}
	return out
}

// openMore opens "vol" once more on c's session, in mode, and returns the
// new handle's VolumeInfo.
func openMore(t *testing.T, c *client, host string, mode protocol.Mode) protocol.VolumeInfo {
	t.Helper()
	var info protocol.VolumeInfo
	if err := c.Request(context.Background(), &protocol.Open{Mode: mode, Name: "vol", HostID: host}, &info); err != nil {
		t.Fatalf("open %v on the same session: %v", mode, err)
	}
	if info.Handle == c.info.Handle {
		t.Fatalf("second open got handle %d again", info.Handle)
	}
	return info
}

// grantOn asks c for a grant of the chunk at off under handle.
func grantOn(t *testing.T, c *client, handle uint32, off uint64, write bool) protocol.Grant {
	t.Helper()
	var g protocol.Grant
	req := &protocol.GrantRequest{Handle: handle, Offset: off}
	if write {
		req.Flags = protocol.GrantWrite
	}
	if err := c.Request(context.Background(), req, &g); err != nil {
		t.Fatalf("grant of %d on handle %d: %v", off, handle, err)
	}
	return g
}

// rdmaWithin does one RDMA READ or WRITE through g with a deadline.
func rdmaWithin(c *client, write bool, g protocol.Grant, off uint64, data []byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.rdma(ctx, write, g, off, data)
}

// TestClosedHandleCannotWriteAfterAnotherWriter: the hostile sequence from
// the field. Host A opens an exclusive export read-only and read-write on
// one session, writes, closes the read-write handle (so host B may attach
// as the export's writer), and writes again through the closed handle's
// rkey: the write must fail, and B's file must not hold its bytes. (Before,
// the read-only handle kept every grant of the session alive.)
func TestClosedHandleCannotWriteAfterAnotherWriter(t *testing.T) {
	content := fenceContent()
	e, _ := startWith(t, content, target.Options{CacheSize: 1 << 20, ChunkSize: fenceChunk}, target.ExportConfig{})
	a, err := e.openAs("host-a", nil, protocol.ModeReadOnly, 0)
	if err != nil {
		t.Fatal(err)
	}
	rw := openMore(t, a, "host-a", protocol.ModeReadWrite)
	ctx := context.Background()
	g := grantOn(t, a, rw.Handle, 0, true)
	if err := rdmaWithin(a, true, g, 0, []byte("A before close")); err != nil {
		t.Fatal(err)
	}
	if err := a.Send(ctx, 0, &protocol.Done{Handle: rw.Handle, Generation: rw.Generation, Ranges: []protocol.Range{{Offset: 0, Length: 14}}}); err != nil {
		t.Fatal(err)
	}
	if err := a.Request(ctx, &protocol.Close{Handle: rw.Handle}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}

	// B attaches as the exclusive writer: A holds no read-write handle.
	b, err := e.openAs("host-b", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatalf("host B's read-write open after A closed its read-write handle: %v", err)
	}
	// A writes through the closed handle's rkey, into the block B writes
	// next, so that B's write-back would carry A's bytes too.
	if err := rdmaWithin(a, true, g, 100, []byte("EVIL!")); !transporttest.Refused(err) {
		t.Errorf("RDMA WRITE through the rkey of a closed read-write handle (its session keeps a read-only one): %v, want a remote access error", err)
	}
	if err := b.writeChunk(t, 0, []byte("BBBB"), b.info.Generation); err != nil {
		t.Fatal(err)
	}
	if err := b.Request(ctx, &protocol.Flush{Handle: b.info.Handle, Generation: b.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	file := readFile(t, e.path)
	if !bytes.Equal(file[100:105], content[100:105]) {
		t.Errorf("B's file holds %q at 100, want %q: A wrote through a closed handle", file[100:105], content[100:105])
	}
	if want := "BBBBfore close"; string(file[:len(want)]) != want {
		t.Errorf("B's file starts %q, want %q", file[:len(want)], want)
	}
}

// TestReadOnlyHandleGrantNotWritable: a read-only handle's grant is never
// writable, even when its session holds a writable grant of the same chunk
// through another handle: no GrantWrite flag, and an RDMA WRITE through it
// fails.
func TestReadOnlyHandleGrantNotWritable(t *testing.T) {
	for _, order := range []string{"read-write first", "read-only first"} {
		t.Run(order, func(t *testing.T) {
			content := fenceContent()
			e := fenceEnv(t, true)
			c, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
			if err != nil {
				t.Fatal(err)
			}
			ro := openMore(t, c, "host-a", protocol.ModeReadOnly)
			var gro, grw protocol.Grant
			if order == "read-only first" {
				gro = grantOn(t, c, ro.Handle, 0, false)
				grw = grantOn(t, c, c.info.Handle, 0, true)
			} else {
				grw = grantOn(t, c, c.info.Handle, 0, true)
				gro = grantOn(t, c, ro.Handle, 0, false)
			}
			if grw.Flags&protocol.GrantWrite == 0 {
				t.Fatal("the read-write handle's grant is not writable")
			}
			if gro.Flags&protocol.GrantWrite != 0 {
				t.Errorf("the read-only handle's grant has GrantWrite")
			}
			if gro.RKey == grw.RKey {
				t.Errorf("both handles got rkey %#x: want a key per handle", gro.RKey)
			}
			// The read-only grant reads (both keys stayed alive) ...
			got := make([]byte, 64)
			if err := rdmaWithin(c, false, gro, 0, got); err != nil {
				t.Fatalf("RDMA READ through the read-only handle's grant: %v", err)
			}
			if !bytes.Equal(got, content[:64]) {
				t.Fatalf("read %q through the read-only grant, want %q", got[:8], content[:8])
			}
			if err := rdmaWithin(c, false, grw, 0, got); err != nil {
				t.Fatalf("RDMA READ through the read-write handle's grant: %v", err)
			}
			// ... and does not write.
			if err := rdmaWithin(c, true, gro, 0, []byte("through a read-only handle")); !transporttest.Refused(err) {
				t.Errorf("RDMA WRITE through the read-only handle's grant: %v, want a remote access error", err)
			}
			chunkHolds(t, e, 0, content[:fenceChunk])
		})
	}
}

// TestCloseKillsExactlyItsGrants: a session with two handles of a volume
// holds two grants (two keys) of a chunk both asked for; closing one handle
// kills exactly its grants: the other handle's key still reads (and sees
// what the closed one wrote), the closed one's no longer writes.
func TestCloseKillsExactlyItsGrants(t *testing.T) {
	content := fenceContent()
	e := fenceEnv(t, true)
	c, err := e.openAs("host-a", nil, protocol.ModeReadOnly, 0)
	if err != nil {
		t.Fatal(err)
	}
	rw := openMore(t, c, "host-a", protocol.ModeReadWrite)
	ro0 := grantOn(t, c, c.info.Handle, 0, false)
	rw0 := grantOn(t, c, rw.Handle, 0, true)
	grantOn(t, c, rw.Handle, fenceChunk, true)
	if ro0.RKey == rw0.RKey {
		t.Fatalf("both handles got rkey %#x: want a key per handle", ro0.RKey)
	}
	ctx := context.Background()
	if err := rdmaWithin(c, true, rw0, 0, []byte("two handles")); err != nil {
		t.Fatal(err)
	}
	if err := c.Send(ctx, 0, &protocol.Done{Handle: rw.Handle, Generation: rw.Generation, Ranges: []protocol.Range{{Offset: 0, Length: 11}}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Request(ctx, &protocol.Close{Handle: rw.Handle}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 11)
	if err := rdmaWithin(c, false, ro0, 0, got); err != nil {
		t.Fatalf("RDMA READ through the open handle's grant after the other handle's Close: %v", err)
	}
	if string(got) != "two handles" {
		t.Fatalf("read %q through the open handle's grant, want what the closed one wrote", got)
	}
	// A new grant of the open handle works too (the session is fine).
	ro1 := grantOn(t, c, c.info.Handle, fenceChunk, false)
	if err := rdmaWithin(c, false, ro1, 0, got); err != nil {
		t.Fatalf("RDMA READ through a new grant of the open handle: %v", err)
	}
	// (A remote access error breaks the connection: one try.)
	if err := rdmaWithin(c, true, rw0, 0, []byte("after close")); !transporttest.Refused(err) {
		t.Errorf("RDMA WRITE through the closed handle's grant: %v, want a remote access error", err)
	}
	chunkHolds(t, e, 0, append([]byte("two handles"), content[11:fenceChunk]...))
	chunkHolds(t, e, fenceChunk, content[fenceChunk:2*fenceChunk])
}

// TestQueuesAreOneShare: a host with two queues (a session and a Join) is
// one share of the cache, as it is with one. The cache holds 16 chunks;
// hosts B and C hold 6 each (the oldest), host A 4, and A asks for one
// more: with three hosts a share is 5 chunks, A is under it, and the
// least recently granted chunk (B's) goes, not one of A's. (Before, each
// queue counted as a share: with 4 a share was 4, and A gave up its own.)
func TestQueuesAreOneShare(t *testing.T) {
	for _, queues := range []int{1, 2} {
		t.Run(fmt.Sprintf("queues=%d", queues), func(t *testing.T) {
			const cs = 64 << 10
			e, _ := startWith(t, make([]byte, 64*cs), target.Options{CacheSize: 16 * cs, ChunkSize: cs}, target.ExportConfig{Shared: true})
			open := func(host string) *recorder {
				r, err := e.dialRecorder(host, 0, &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol", HostID: host})
				if err != nil {
					t.Fatal(err)
				}
				return r
			}
			b, c, a := open("host-b"), open("host-c"), open("host-a")
			all := []*recorder{a}
			if queues == 2 {
				q, err := e.dialRecorder("host-a", 0, &protocol.Join{Mode: protocol.ModeReadWrite, Name: "vol", HostID: "host-a", Generation: a.info.Generation})
				if err != nil {
					t.Fatal(err)
				}
				all = append(all, q)
			}
			for i := range 16 {
				who := a
				switch {
				case i < 6:
					who = b
				case i < 12:
					who = c
				}
				grantOn(t, who.client, who.info.Handle, uint64(i)*cs, false)
			}
			grantOn(t, a.client, a.info.Handle, 16*cs, false) // the cache is full: one chunk goes
			for _, r := range all {
				if got := r.revoked(); len(got) != 0 {
					t.Errorf("host A (%d queues, 4 of 16 chunks, share 5) got revokes of %v: treated as over its share", queues, got)
				}
			}
			if got := b.revoked(); len(got) == 0 || got[0] != 0 {
				t.Errorf("host B got revokes of %v, want the least recently granted chunk, 0", got)
			}
		})
	}
}

// TestSlowInitiatorKeepsSession: an initiator that answers revokes slowly
// (after more than a tenth of the revoke timeout, well within it) and
// holds more than its share is never dropped: every holder has the whole
// revoke timeout. (Before, a holder over its share got a tenth.)
func TestSlowInitiatorKeepsSession(t *testing.T) {
	const cs = 64 << 10
	const revokeTTL = 3 * time.Second
	e, reg := startWith(t, make([]byte, 64*cs), target.Options{CacheSize: 16 * cs, ChunkSize: cs, RevokeTimeout: revokeTTL},
		target.ExportConfig{Shared: true})
	slow, err := e.dialRecorder("slow", revokeTTL/3, &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol", HostID: "slow"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 12 {
		grantOn(t, slow.client, slow.info.Handle, uint64(i)*cs, true)
	}
	other, err := e.dialRecorder("other", 0, &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol", HostID: "other"})
	if err != nil {
		t.Fatal(err)
	}
	// Two hosts: a share is 8 chunks, the slow one holds 12. The other
	// host's grants past the 4 free slots evict the slow one's chunks.
	for i := 16; i < 24; i++ {
		grantOn(t, other.client, other.info.Handle, uint64(i)*cs, false)
	}
	if len(slow.revoked()) == 0 {
		t.Fatal("the slow host got no revoke")
	}
	// Wait until every revoke sent ended (answered, or timed out).
	deadline := time.Now().Add(3 * revokeTTL)
	for counter(t, reg, "rblkd_revokes_total") < float64(len(slow.revoked())+len(other.revoked())) {
		if time.Now().After(deadline) {
			t.Fatal("the revokes did not end")
		}
		time.Sleep(10 * time.Millisecond) // polling a counter, bounded by the deadline
	}
	ctx := context.Background()
	if err := slow.Request(ctx, &protocol.Flush{Handle: slow.info.Handle, Generation: slow.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatalf("the slow host's session after answering its revokes within the timeout: %v", err)
	}
	if n := counter(t, reg, "rblkd_revoke_timeouts_total"); n != 0 {
		t.Fatalf("%v revoke timeouts for an initiator that answered within %v", n, revokeTTL)
	}
}

// TestSecondWriterHandleKeepsExclusivity: a session with two read-write
// handles of an exclusive export closes one; it still writes through the
// other, so another host's read-write open is refused (busy), and a
// takeover fences the session. (Before, closing the handle the target
// remembered as the export's writer forgot the writer altogether: another
// host opened read-write beside the open handle, two writers.)
func TestSecondWriterHandleKeepsExclusivity(t *testing.T) {
	e := fenceEnv(t, false)
	a, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	second := openMore(t, a, "host-a", protocol.ModeReadWrite)
	ctx := context.Background()
	if err := a.Request(ctx, &protocol.Close{Handle: second.Handle}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	g := grantOn(t, a, a.info.Handle, 0, true)
	if _, err := e.openAs("host-b", nil, protocol.ModeReadWrite, 0); !errors.Is(err, protocol.ErrBusy) {
		t.Fatalf("host B's read-write open while host A keeps a read-write handle: %v, want ErrBusy", err)
	}
	if _, err := e.openAs("host-b", nil, protocol.ModeReadWrite, protocol.OpenTakeover); err != nil {
		t.Fatalf("host B's takeover: %v", err)
	}
	waitDown(t, a.Link, "host A taken over")
	if err := rdmaWithin(a, true, g, 0, []byte("A after takeover")); err == nil {
		t.Fatal("host A wrote after the takeover")
	}
}
