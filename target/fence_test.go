package target_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport"
)

// dialAs opens the export as host with a raw client whose handler answers
// revokes (unless ignoreRevokes), after ackDelay, and tells c.revoked.
func (e *env) dialAs(host string, ignoreRevokes bool, ackDelay time.Duration) (*client, error) {
	return e.dialOpen(host, ignoreRevokes, ackDelay, &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol", HostID: host})
}

// dialOpen is dialAs with the message that opens the volume: an Open, or a
// Join.
func (e *env) dialOpen(host string, ignoreRevokes bool, ackDelay time.Duration, open protocol.Message) (*client, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	revoked := make(chan uint64, 64)
	var l *link.Link
	ready := make(chan struct{})
	l, err := link.Dial(ctx, e.p, e.addr, link.Options{Handler: func(h protocol.Header, p []byte) {
		<-ready
		var r protocol.Revoke
		if h.Type != protocol.TypeRevoke || r.Unmarshal(p) != nil || ignoreRevokes {
			return
		}
		go func() {
			select {
			case <-time.After(ackDelay): // the initiator's own slowness under test
			case <-l.Done():
				return
			}
			if l.Send(context.Background(), h.Tag, &protocol.RevokeAck{Handle: r.Handle, Offset: r.Offset, Generation: r.Generation}) == nil {
				select {
				case revoked <- r.Offset:
				default:
				}
			}
		}()
	}})
	if err != nil {
		return nil, err
	}
	close(ready)
	e.t.Cleanup(func() { l.Close() })
	c := &client{Link: l, revoked: revoked}
	if _, err := auth.Initiate(ctx, l, host, nil); err != nil {
		return nil, err
	}
	return c, l.Request(ctx, open, &c.info)
}

// writeChunk writes data at off through a fresh grant and reports it with
// a Done of generation gen.
func (c *client) writeChunk(t *testing.T, off uint64, data []byte, gen uint64) error {
	t.Helper()
	ctx := context.Background()
	var g protocol.Grant
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: off}, &g); err != nil {
		return err
	}
	mem, err := transport.AllocMemory(len(data), false)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	local, err := c.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		return err
	}
	defer local.Deregister()
	copy(local.Bytes(), data)
	if err := c.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: len(data)}, Addr: g.Addr + off - g.Offset, RKey: g.RKey}); err != nil {
		return err
	}
	return c.Send(ctx, 0, &protocol.Done{Handle: c.info.Handle, Generation: gen, Ranges: []protocol.Range{{Offset: off, Length: uint64(len(data))}}})
}

// TestReinstatementFencesEarlierSession: when a host opens an export again
// (it reconnected), its earlier session is closed and its grants are dead
// before the new Open returns, so nothing the old connection still carries
// can land; the new session writes, flushes, and the file holds its data.
// Done and Flush of another generation are refused.
func TestReinstatementFencesEarlierSession(t *testing.T) {
	e := start(t, false, make([]byte, 1<<20))
	old, err := e.dialAs("host-a", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.writeChunk(t, 4096, bytes.Repeat([]byte("old!"), 1024), old.info.Generation); err != nil {
		t.Fatal(err)
	}
	// The old session holds a writable grant; keep it for later.
	var stale protocol.Grant
	ctx := context.Background()
	if err := old.Request(ctx, &protocol.GrantRequest{Handle: old.info.Handle, Flags: protocol.GrantWrite, Offset: 0}, &stale); err != nil {
		t.Fatal(err)
	}

	// Another host is not fenced by host-a coming back.
	other, err := e.dialAs("host-b", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := e.dialAs("host-a", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	if cur.info.Generation <= old.info.Generation {
		t.Fatalf("new generation %d, old %d: want it higher", cur.info.Generation, old.info.Generation)
	}
	// Once the new Open returned, an RDMA WRITE through the old session's
	// grant cannot land: its region is deregistered and its connection
	// closed on the target (the old client learns of the close a moment
	// later; its write fails either way).
	mem, err := transport.AllocMemory(4096, false)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	if local, err := old.Conn().Register(mem.Bytes(), transport.AccessLocalWrite); err == nil {
		copy(local.Bytes(), "stale")
		err = old.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: 5}, Addr: stale.Addr, RKey: stale.RKey})
		if err == nil {
			t.Fatal("an RDMA WRITE through the fenced session's grant completed")
		}
		local.Deregister()
	}
	select {
	case <-old.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the earlier session of host-a is still up")
	}
	if other.Err() != nil {
		t.Fatalf("host-b's session went down: %v", other.Err())
	}
	newer := bytes.Repeat([]byte("new!"), 1024)
	if err := cur.writeChunk(t, 4096, newer, cur.info.Generation); err != nil {
		t.Fatal(err)
	}
	if err := cur.Request(ctx, &protocol.Flush{Handle: cur.info.Handle, Generation: cur.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(e.path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file[4096:8192], newer) || !bytes.Equal(file[:5], make([]byte, 5)) {
		t.Fatalf("file holds %q... at 0 and %q... at 4096, want zeroes and the new session's data", file[:5], file[4096:4100])
	}
	// A Flush naming another generation is refused and the session goes on.
	err = cur.Request(ctx, &protocol.Flush{Handle: cur.info.Handle, Generation: old.info.Generation}, &protocol.OK{})
	if !errors.Is(err, protocol.ErrStale) {
		t.Fatalf("flush of an old generation: %v, want ErrStale", err)
	}
	// A Done naming another generation closes the session: a broken
	// initiator.
	if err := cur.Send(ctx, 0, &protocol.Done{Handle: cur.info.Handle, Generation: old.info.Generation,
		Ranges: []protocol.Range{{Offset: 0, Length: 1}}}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-cur.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a Done of an old generation did not close the session")
	}
}

func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	return metricstest.Value(t, reg, name)
}

// readChunk reads one byte of the chunk at off through a fresh grant and
// returns how long the grant took.
func (c *client) grantTime(t *testing.T, off uint64) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	var g protocol.Grant
	err := c.Request(context.Background(), &protocol.GrantRequest{Handle: c.info.Handle, Offset: off}, &g)
	return time.Since(start), err
}

// TestGrantHogDoesNotStallOthers: a session that holds grants on the whole
// cache and never answers a revoke delays another initiator's grants by
// the revoke timeout once (every holder has the whole timeout to answer:
// a slow but healthy one must not be dropped), not by one timeout per
// chunk, loses its session, and when it comes back at once it cannot take
// the cache again.
func TestGrantHogDoesNotStallOthers(t *testing.T) {
	const revokeTTL = 2 * time.Second
	e, reg := startWith(t, make([]byte, 4<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, RevokeTimeout: revokeTTL}, target.ExportConfig{Shared: true})
	hog, err := e.dialAs("hog", true, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i := range 16 { // the whole cache
		var g protocol.Grant
		if err := hog.Request(ctx, &protocol.GrantRequest{Handle: hog.info.Handle, Offset: uint64(i) << 16}, &g); err != nil {
			t.Fatal(err)
		}
	}
	good, err := e.dialAs("good", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	var total time.Duration
	for i := 16; i < 48; i++ {
		d, err := good.grantTime(t, uint64(i)<<16)
		if err != nil {
			t.Fatalf("grant %d: %v", i, err)
		}
		total += d
	}
	if total > 2*revokeTTL {
		t.Fatalf("32 grants took %v behind the hog (revoke timeout %v): want about one timeout", total, revokeTTL)
	}
	waitDown(t, hog.Link, "the hog")
	if n := counter(t, reg, "rblkd_revoke_timeouts_total"); n < 1 {
		t.Fatalf("revoke timeouts %v, want at least 1", n)
	}
	var worst time.Duration
	// The hog comes back at once and grabs again: the good initiator still
	// gets its grants in bounded time, and the hog holds little of the cache.
	hog2, err := e.dialAs("hog", true, 0)
	if err != nil {
		t.Fatal(err)
	}
	hogDone := make(chan struct{})
	go func() {
		defer close(hogDone)
		for i := range 64 {
			var g protocol.Grant
			if hog2.Request(ctx, &protocol.GrantRequest{Handle: hog2.info.Handle, Offset: uint64(i%64) << 16}, &g) != nil {
				return
			}
		}
	}()
	for i := range 32 {
		d, err := good.grantTime(t, uint64(63-i)<<16)
		if err != nil {
			t.Fatalf("grant %d with the hog back: %v", i, err)
		}
		worst = max(worst, d)
	}
	if worst > revokeTTL/3 {
		t.Fatalf("with the hog back, a grant waited %v (revoke timeout %v)", worst, revokeTTL)
	}
	hog2.Close()
	<-hogDone
}

// TestEvictionOutlivesRequester: the session whose grant needed an
// eviction goes away while the holder is still answering the revoke; the
// holder is not closed (before, the revoke ran under the requester's
// context and the holder was dropped as if it had not answered).
func TestEvictionOutlivesRequester(t *testing.T) {
	e, reg := startWith(t, make([]byte, 2<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, RevokeTimeout: 10 * time.Second}, target.ExportConfig{Shared: true})
	holder, err := e.dialAs("holder", false, 400*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.writeChunk(t, 0, []byte("held"), holder.info.Generation); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i := 1; i < 16; i++ {
		var g protocol.Grant
		if err := holder.Request(ctx, &protocol.GrantRequest{Handle: holder.info.Handle, Offset: uint64(i) << 16}, &g); err != nil {
			t.Fatal(err)
		}
	}
	req, err := e.dialAs("requester", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	// The grant needs an eviction; the requester leaves before it is done.
	req.Request(rctx, &protocol.GrantRequest{Handle: req.info.Handle, Offset: 16 << 16}, &protocol.Grant{})
	req.Close()
	// The holder answers its revoke late, and keeps its session.
	deadline := time.Now().Add(10 * time.Second)
	for counter(t, reg, "rblkd_revokes_total") < 1 {
		if time.Now().After(deadline) {
			t.Fatal("no revoke was sent")
		}
		time.Sleep(10 * time.Millisecond) // polling a counter, bounded by the deadline
	}
	if err := holder.Request(ctx, &protocol.Flush{Handle: holder.info.Handle, Generation: holder.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatalf("the holder's flush after the requester left: %v", err)
	}
	if holder.Err() != nil {
		t.Fatalf("the holder's session went down: %v", holder.Err())
	}
	if n := counter(t, reg, "rblkd_revoke_timeouts_total"); n != 0 {
		t.Fatalf("%v revoke timeouts", n)
	}
	file, _ := os.ReadFile(e.path)
	if string(file[:4]) != "held" {
		t.Fatalf("file holds %q, want the holder's write", file[:4])
	}
}
