package transporttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/transport"
)

// WindowStats is implemented by a Conn that counts its memory windows, so
// that the suite can tell a leak: live is the windows bound and not yet
// invalidated, allocated the window objects the connection holds (a verbs
// provider pools them).
type WindowStats interface {
	WindowStats() (live, allocated int)
}

// windowTests are the subtests of Run about transport.WindowBinder.
var windowTests = []struct {
	name string
	fn   func(e *env)
}{
	{"WindowReadWrite", testWindowReadWrite},
	{"WindowBindChecks", testWindowBindChecks},
	{"WindowReadOnly", testWindowReadOnly},
	{"WindowOutOfSpan", testWindowOutOfSpan},
	{"WindowInvalidated", testWindowInvalidated},
	{"WindowOtherConn", testWindowOtherConn},
	{"WindowDeregisteredRegion", testWindowDeregisteredRegion},
	{"WindowAfterClose", testWindowAfterClose},
	{"WindowCycles", testWindowCycles},
}

// binder returns c as a WindowBinder, or skips the test, saying so.
func (e *env) binder(c transport.Conn) transport.WindowBinder {
	e.t.Helper()
	wb, ok := c.(transport.WindowBinder)
	if !ok {
		e.t.Skipf("SKIP: %T does not implement transport.WindowBinder; memory windows are not tested", c)
	}
	return wb
}

// bind binds a window, skipping the test if the provider says the device
// has no memory windows.
func (e *env) bind(c transport.Conn, r transport.Region, off, n int, access transport.Access) transport.Window {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	w, err := e.binder(c).BindWindow(ctx, r, off, n, access)
	if errors.Is(err, transport.ErrUnsupported) {
		e.t.Logf("MEMORY WINDOWS UNSUPPORTED: %v", err)
		e.t.Skipf("SKIP: no memory windows on this connection: %v", err)
	}
	if err != nil {
		e.t.Fatalf("bind window [%d, +%d) %v: %v", off, n, access, err)
	}
	if w.Addr() != r.Addr()+uint64(off) || w.Access() != access {
		e.t.Errorf("window at %#x with %v, want %#x with %v", w.Addr(), w.Access(), r.Addr()+uint64(off), access)
	}
	if w.RKey() == r.RKey() {
		e.t.Errorf("the window has the rkey %#x of its region", w.RKey())
	}
	return w
}

func (e *env) invalidate(w transport.Window) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := w.Invalidate(ctx); err != nil {
		e.t.Fatalf("invalidate: %v", err)
	}
}

// poller polls a Conn in the background, as the link layer does, and keeps
// what it got: binds and invalidations need the Conn polled.
type poller struct {
	c      transport.Conn
	cancel context.CancelFunc
	done   chan struct{}
	more   chan struct{}

	mu  sync.Mutex
	got []transport.Completion
	err error
}

// startPoller polls c until stop, or until c is closed.
func (e *env) startPoller(c transport.Conn) *poller {
	ctx, cancel := context.WithCancel(context.Background())
	p := &poller{c: c, cancel: cancel, done: make(chan struct{}), more: make(chan struct{}, 1)}
	go func() {
		defer close(p.done)
		out := make([]transport.Completion, 16)
		for {
			n, err := c.Poll(ctx, out)
			p.mu.Lock()
			p.got = append(p.got, out[:n]...)
			if err != nil {
				p.err = err
			}
			p.mu.Unlock()
			select {
			case p.more <- struct{}{}:
			default:
			}
			if err != nil {
				return
			}
		}
	}()
	e.t.Cleanup(func() { p.stop() })
	return p
}

// stop ends the polling and returns everything polled.
func (p *poller) stop() []transport.Completion {
	p.cancel()
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.got
}

// waitFor waits until a completion with id was polled and returns it.
func (p *poller) waitFor(t *testing.T, id uint64) transport.Completion {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		p.mu.Lock()
		for _, c := range p.got {
			if c.ID == id {
				p.mu.Unlock()
				return c
			}
		}
		err := p.err
		p.mu.Unlock()
		if err != nil {
			t.Fatalf("waiting for completion %d: poll: %v", id, err)
		}
		select {
		case <-p.more:
		case <-time.After(10 * time.Millisecond): // (another waiter took the token)
		case <-deadline:
			t.Fatalf("completion %d did not come", id)
		}
	}
}

// waitCount waits until n completions were polled.
func (p *poller) waitCount(n int) error {
	deadline := time.After(waitTimeout)
	for {
		p.mu.Lock()
		got, err := len(p.got), p.err
		p.mu.Unlock()
		if got >= n {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%d of %d completions polled: %w", got, n, err)
		}
		select {
		case <-p.more:
		case <-time.After(10 * time.Millisecond): // (another waiter took the token)
		case <-deadline:
			return fmt.Errorf("%d of %d completions polled in %v", got, n, waitTimeout)
		}
	}
}

// notifyPolled is notify for a b polled by p.
func (e *env) notifyPolled(p *poller, src, dst transport.Region, id uint64) {
	e.t.Helper()
	e.postRecv(e.b, recvRR(id, dst, 0, len(dst.Bytes())))
	e.postSend(e.a, sendWR(id, src, 0, 1))
	e.check(p.waitFor(e.t, id), id, transport.OpRecv, transport.StatusSuccess)
	e.check(e.wait(e.a, 1)[0], id, transport.OpSend, transport.StatusSuccess)
}

// winWR is a one-sided request of a on the window w of b.
func winWR(id uint64, op transport.Opcode, local transport.Region, loff, n int, w transport.Window, woff int64) transport.WorkRequest {
	return transport.WorkRequest{
		ID: id, Op: op,
		Local:      transport.SGE{Region: local, Offset: loff, Length: n},
		RemoteAddr: uint64(int64(w.Addr()) + woff),
		RKey:       w.RKey(),
	}
}

// cache is what a target registers once: local access and windows only,
// no remote access of its own.
const cache = transport.AccessLocalWrite | transport.AccessBindWindow

// testWindowReadWrite: the peer READs and WRITEs a span through a window
// bound over part of a region without remote rights, and nothing outside
// the span changes.
func testWindowReadWrite(e *env) {
	const size, off, span = 64 << 10, 8192, 16384
	p := e.startPoller(e.b)
	rb := e.region(e.b, size, cache)
	la := e.region(e.a, 2*span, rw)
	ctlA := e.region(e.a, 16, rw)
	ctlB := e.region(e.b, 16, rw)
	w := e.bind(e.b, rb, off, span, transport.AccessRemoteRead|transport.AccessRemoteWrite)
	fill(la.Bytes()[:span], 21)
	e.postSend(e.a, winWR(1, transport.OpWrite, la, 0, span, w, 0))
	e.check(e.wait(e.a, 1)[0], 1, transport.OpWrite, transport.StatusSuccess)
	e.notifyPolled(p, ctlA, ctlB, 2)
	d := rb.Bytes()
	if !bytes.Equal(d[off:off+span], la.Bytes()[:span]) {
		e.t.Error("data written through the window differs")
	}
	if bytes.ContainsFunc(d[:off], func(r rune) bool { return r != 0 }) || bytes.ContainsFunc(d[off+span:], func(r rune) bool { return r != 0 }) {
		e.t.Error("bytes of the region outside the window changed")
	}
	// READ back through the window: the whole span, then its last byte.
	fill(d[off:off+span], 22)
	e.postSend(e.a, winWR(3, transport.OpRead, la, span, span, w, 0), winWR(4, transport.OpRead, la, 0, 1, w, span-1))
	got := e.wait(e.a, 2)
	e.check(got[0], 3, transport.OpRead, transport.StatusSuccess)
	e.check(got[1], 4, transport.OpRead, transport.StatusSuccess)
	if !bytes.Equal(la.Bytes()[span:], d[off:off+span]) || la.Bytes()[0] != d[off+span-1] {
		e.t.Error("data read through the window differs")
	}
	e.invalidate(w)
	if err := w.Invalidate(context.Background()); err != nil {
		e.t.Errorf("second invalidate: %v", err)
	}
	// The connection is still up: the link goes on.
	e.notifyPolled(p, ctlA, ctlB, 5)
	for _, c := range p.stop() {
		if c.ID != 2 && c.ID != 5 {
			e.t.Errorf("the poller got %+v, which is none of the link's", c)
		}
	}
}

// testWindowBindChecks: binds that make no sense are refused before
// anything is posted, and the connection stays up.
func testWindowBindChecks(e *env) {
	p := e.startPoller(e.b)
	rb := e.region(e.b, 8192, cache)
	plain := e.region(e.b, 8192, all)
	ro := e.region(e.b, 8192, transport.AccessRemoteRead|transport.AccessBindWindow)
	foreign := e.region(e.a, 8192, cache)
	ctlA := e.region(e.a, 16, rw)
	ctlB := e.region(e.b, 16, rw)
	e.invalidate(e.bind(e.b, rb, 0, 4096, transport.AccessRemoteRead)) // (skips without windows)
	wb := e.binder(e.b)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	for _, tc := range []struct {
		name     string
		r        transport.Region
		off, n   int
		access   transport.Access
		canceled bool
	}{
		{name: "region without bind-window", r: plain, n: 4096, access: transport.AccessRemoteRead},
		{name: "writable window on a region without local write", r: ro, n: 4096, access: transport.AccessRemoteWrite},
		{name: "no access", r: rb, n: 4096},
		{name: "local access", r: rb, n: 4096, access: transport.AccessLocalWrite},
		{name: "beyond the end", r: rb, off: 4096, n: 4097, access: transport.AccessRemoteRead},
		{name: "negative offset", r: rb, off: -1, n: 10, access: transport.AccessRemoteRead},
		{name: "empty", r: rb, n: 0, access: transport.AccessRemoteRead},
		{name: "region of another conn", r: foreign, n: 4096, access: transport.AccessRemoteRead},
		{name: "context canceled", r: rb, n: 4096, access: transport.AccessRemoteRead, canceled: true},
	} {
		c := ctx
		if tc.canceled {
			cc, cancel := context.WithCancel(ctx)
			cancel()
			c = cc
		}
		w, err := wb.BindWindow(c, tc.r, tc.off, tc.n, tc.access)
		if err == nil {
			e.t.Errorf("%s: bind succeeded", tc.name)
			e.invalidate(w)
			continue
		}
		if tc.canceled && !errors.Is(err, context.Canceled) {
			e.t.Errorf("%s: %v, want context canceled", tc.name, err)
		}
	}
	e.notifyPolled(p, ctlA, ctlB, 1)
}

// refusedWindow posts [good WRITE, bad, good WRITE] from a and checks they
// complete success, remote access error, flushed, and that b broke.
func (e *env) refusedWindow(p *poller, bad transport.WorkRequest, la, rb transport.Region) {
	e.t.Helper()
	e.refusedBetween(bad, la, rb)
	select {
	case <-p.done:
	case <-time.After(waitTimeout):
		e.t.Fatal("the window's side did not break")
	}
	if _, err := e.b.Poll(context.Background(), make([]transport.Completion, 1)); !errors.Is(err, transport.ErrClosed) {
		e.t.Errorf("poll of the window's side: %v, want ErrClosed", err)
	}
}

// windowCase makes a fresh pair, a region of b with a window over
// [off, off+span), a local region of a and a plain remote one, and runs fn.
func (e *env) windowCase(name string, access transport.Access, fn func(e *env, p *poller, w transport.Window, la, rb, cache transport.Region)) {
	e.t.Run(name, func(t *testing.T) {
		sub := e.sub(t)
		p := sub.startPoller(sub.b)
		c := sub.region(sub.b, 16384, cache)
		rb := sub.region(sub.b, 4096, all)
		la := sub.region(sub.a, 16384, rw)
		w := sub.bind(sub.b, c, 4096, 8192, access)
		fill(c.Bytes(), 31)
		fn(sub, p, w, la, rb, c)
	})
}

// unchanged checks that the region's bytes are still those fill(seed) made.
func (e *env) unchanged(r transport.Region, seed uint64) {
	e.t.Helper()
	want := make([]byte, len(r.Bytes()))
	fill(want, seed)
	if !bytes.Equal(r.Bytes(), want) {
		e.t.Error("the memory behind the window changed")
	}
}

// testWindowReadOnly: a WRITE through a read-only window is refused, a READ
// through a write-only one too, and the memory is unchanged.
func testWindowReadOnly(e *env) {
	e.windowCase("WriteToReadOnly", transport.AccessRemoteRead, func(e *env, p *poller, w transport.Window, la, rb, c transport.Region) {
		fill(la.Bytes(), 32)
		e.refusedWindow(p, winWR(0, transport.OpWrite, la, 0, 64, w, 0), la, rb)
		e.unchanged(c, 31)
	})
	e.windowCase("ReadFromWriteOnly", transport.AccessRemoteWrite, func(e *env, p *poller, w transport.Window, la, rb, c transport.Region) {
		e.refusedWindow(p, winWR(0, transport.OpRead, la, 0, 64, w, 0), la, rb)
		if bytes.ContainsFunc(la.Bytes(), func(r rune) bool { return r != 0 }) {
			e.t.Error("a refused READ placed data")
		}
		e.unchanged(c, 31)
	})
}

// testWindowOutOfSpan: requests reaching outside the window's span are
// refused: beyond its region always, inside its region where the device
// checks spans (transport.WindowSpanChecker; a device that does not is
// reported loudly).
func testWindowOutOfSpan(e *env) {
	const both = transport.AccessRemoteRead | transport.AccessRemoteWrite
	for _, tc := range []struct {
		name     string
		op       transport.Opcode
		off      int64
		n        int
		inRegion bool // outside the window, inside its region
	}{
		{"WriteBelowStart", transport.OpWrite, -8, 16, true},
		{"WriteBeyondEnd", transport.OpWrite, 8192 - 8, 16, true},
		{"ReadBelowStart", transport.OpRead, -1, 1, true},
		{"ReadPastEnd", transport.OpRead, 8192, 1, true},
		{"WriteBelowRegion", transport.OpWrite, -4096 - 8, 16, false},
		{"ReadBeyondRegion", transport.OpRead, 8192 + 4096 - 4, 8, false},
	} {
		if sc, ok := e.b.(transport.WindowSpanChecker); tc.inRegion && ok && !sc.WindowSpanChecked() {
			e.t.Logf("WINDOW SPANS NOT CHECKED BY THE DEVICE: %s skipped: through a window the peer reaches its whole region", tc.name)
			continue
		}
		e.windowCase(tc.name, both, func(e *env, p *poller, w transport.Window, la, rb, c transport.Region) {
			fill(la.Bytes(), 33)
			e.refusedWindow(p, winWR(0, tc.op, la, 0, tc.n, w, tc.off), la, rb)
			e.unchanged(c, 31)
		})
	}
}

// testWindowInvalidated: after Invalidate, a READ and a WRITE through the
// window's rkey are refused and the memory is unchanged.
func testWindowInvalidated(e *env) {
	const both = transport.AccessRemoteRead | transport.AccessRemoteWrite
	for _, op := range []transport.Opcode{transport.OpRead, transport.OpWrite} {
		e.windowCase(op.String(), both, func(e *env, p *poller, w transport.Window, la, rb, c transport.Region) {
			fill(la.Bytes(), 34)
			// It works until the invalidation.
			e.postSend(e.a, winWR(9, transport.OpRead, la, 8192, 64, w, 0))
			e.check(e.wait(e.a, 1)[0], 9, transport.OpRead, transport.StatusSuccess)
			if !bytes.Equal(la.Bytes()[8192:8192+64], c.Bytes()[4096:4096+64]) {
				e.t.Error("read through the window differs")
			}
			e.invalidate(w)
			e.invalidate(w) // twice is fine
			before := bytes.Clone(la.Bytes())
			e.refusedWindow(p, winWR(0, op, la, 0, 64, w, 0), la, rb)
			e.unchanged(c, 31)
			if !bytes.Equal(before, la.Bytes()) {
				e.t.Errorf("a refused %v through an invalidated window changed local memory", op)
			}
		})
	}
}

// testWindowOtherConn: a window's rkey means nothing through another
// connection, even one to the same peer process.
func testWindowOtherConn(e *env) {
	pb := e.startPoller(e.b)
	c := e.region(e.b, 8192, cache)
	fill(c.Bytes(), 35)
	w := e.bind(e.b, c, 0, 8192, transport.AccessRemoteRead|transport.AccessRemoteWrite)
	e.t.Run("Read", func(t *testing.T) {
		sub := e.sub(t)
		p := sub.startPoller(sub.b)
		la := sub.region(sub.a, 8192, rw)
		rb := sub.region(sub.b, 4096, all)
		sub.refusedWindow(p, winWR(0, transport.OpRead, la, 0, 64, w, 0), la, rb)
		if bytes.ContainsFunc(la.Bytes()[8:], func(r rune) bool { return r != 0 }) {
			t.Error("a READ through another connection placed data")
		}
	})
	e.t.Run("Write", func(t *testing.T) {
		sub := e.sub(t)
		p := sub.startPoller(sub.b)
		la := sub.region(sub.a, 8192, rw)
		fill(la.Bytes(), 36)
		rb := sub.region(sub.b, 4096, all)
		sub.refusedWindow(p, winWR(0, transport.OpWrite, la, 0, 64, w, 0), la, rb)
	})
	e.unchanged(c, 35)
	// Through its own connection it still works.
	la := e.region(e.a, 64, rw)
	e.postSend(e.a, winWR(1, transport.OpRead, la, 0, 64, w, 0))
	e.check(e.wait(e.a, 1)[0], 1, transport.OpRead, transport.StatusSuccess)
	if !bytes.Equal(la.Bytes(), c.Bytes()[:64]) {
		e.t.Error("read through the window differs")
	}
	e.invalidate(w)
	pb.stop()
}

// testWindowDeregisteredRegion: deregistering a region kills its windows.
func testWindowDeregisteredRegion(e *env) {
	p := e.startPoller(e.b)
	c := e.region(e.b, 8192, cache)
	rb := e.region(e.b, 4096, all)
	la := e.region(e.a, 8192, rw)
	fill(c.Bytes(), 37)
	w := e.bind(e.b, c, 0, 4096, transport.AccessRemoteRead|transport.AccessRemoteWrite)
	if err := c.Deregister(); err != nil {
		e.t.Fatalf("deregister a region with a window bound: %v", err)
	}
	if err := w.Invalidate(context.Background()); err != nil {
		e.t.Errorf("invalidate a window of a deregistered region: %v", err)
	}
	fill(la.Bytes(), 38)
	e.refusedWindow(p, winWR(0, transport.OpWrite, la, 0, 64, w, 0), la, rb)
	e.unchanged(c, 37)
}

// testWindowAfterClose: once the connection is closed or broken, Invalidate
// returns nil (the window died with it) and BindWindow fails.
func testWindowAfterClose(e *env) {
	for _, closeSide := range []string{"self", "peer"} {
		e.t.Run(closeSide, func(t *testing.T) {
			sub := e.sub(t)
			p := sub.startPoller(sub.b)
			c := sub.region(sub.b, 8192, cache)
			w := sub.bind(sub.b, c, 0, 4096, transport.AccessRemoteRead)
			if closeSide == "self" {
				sub.b.Close()
			} else {
				sub.a.Close()
			}
			select {
			case <-p.done:
			case <-time.After(waitTimeout):
				t.Fatal("the window's side did not break")
			}
			for i := range 2 {
				if err := w.Invalidate(context.Background()); err != nil {
					t.Errorf("invalidate %d after the close: %v, want nil", i+1, err)
				}
			}
			if _, err := sub.binder(sub.b).BindWindow(context.Background(), c, 0, 4096, transport.AccessRemoteRead); err == nil {
				t.Error("bind on a closed connection succeeded")
			} else if closeSide == "peer" && !errors.Is(err, transport.ErrClosed) {
				// (after a local Close the region itself is gone)
				t.Errorf("bind on a broken connection: %v, want ErrClosed", err)
			}
			sub.b.Close()
		})
	}
}

// testWindowCycles binds and invalidates windows many times, from a few
// goroutines, while the same connection carries link traffic (SENDs to the
// peer) polled by one poller: the link sees its own completions only, and
// nothing leaks.
func testWindowCycles(e *env) {
	cycles, workers := 400, 3
	if testing.Short() {
		cycles = 60
	}
	p := e.startPoller(e.b)
	c := e.region(e.b, 1<<20, cache)
	src := e.region(e.b, 64, rw)
	dst := e.region(e.a, 64*64, rw)
	e.invalidate(e.bind(e.b, c, 0, 4096, transport.AccessRemoteRead)) // (skips without windows)
	wb := e.binder(e.b)

	// Link traffic: b SENDs to a, one at a time, a takes them.
	const sends = 200
	linkErr := make(chan error, 1)
	go func() {
		linkErr <- func() error {
			for i := range sends {
				if err := e.a.PostRecv(recvRR(uint64(i), dst, (i%64)*64, 64)); err != nil {
					return err
				}
				if err := e.b.PostSend(sendWR(uint64(1000+i), src, 0, 8)); err != nil {
					return err
				}
				got, err := poll(e.a, 1)
				if err != nil {
					return err
				}
				if got[0].ID != uint64(i) || got[0].Status != transport.StatusSuccess {
					return fmt.Errorf("receive %d: %+v", i, got[0])
				}
				// As the link does, count the SEND done when b polled it.
				if err := p.waitCount(i + 1); err != nil {
					return err
				}
			}
			return nil
		}()
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 4*waitTimeout)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range cycles {
				off := ((g*cycles + i) % 255) * 4096
				w, err := wb.BindWindow(ctx, c, off, 4096, transport.AccessRemoteRead|transport.AccessRemoteWrite)
				if err != nil {
					errs <- fmt.Errorf("worker %d cycle %d: bind: %w", g, i, err)
					return
				}
				if err := w.Invalidate(ctx); err != nil {
					errs <- fmt.Errorf("worker %d cycle %d: invalidate: %w", g, i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		e.t.Error(err)
	}
	if err := <-linkErr; err != nil {
		e.t.Fatalf("link traffic: %v", err)
	}
	got := p.stop()
	if len(got) != sends {
		e.t.Errorf("the poller got %d completions, want the %d of the SENDs", len(got), sends)
	}
	for i, comp := range got {
		if comp.ID != uint64(1000+i) || comp.Op != transport.OpSend || comp.Status != transport.StatusSuccess {
			e.t.Errorf("poller completion %d: %+v, want SEND %d", i, comp, 1000+i)
			break
		}
	}
	if s, ok := e.b.(WindowStats); ok {
		live, allocated := s.WindowStats()
		e.t.Logf("after %d bind/invalidate cycles: %d windows live, %d allocated", workers*cycles+1, live, allocated)
		if live != 0 || allocated > workers+1 {
			e.t.Errorf("after %d cycles: %d windows live, %d allocated: a leak", workers*cycles+1, live, allocated)
		}
	}
}

// testRegisterFileMapping: memory that maps a file is refused with
// ErrFileMapping, shared or private; a memfd (shmem) is not a file.
func testRegisterFileMapping(e *env) {
	const size = 64 << 10
	f, err := os.Create(filepath.Join(e.t.TempDir(), "mapped"))
	if err != nil {
		e.t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		e.t.Fatal(err)
	}
	for _, flags := range []int{unix.MAP_SHARED, unix.MAP_PRIVATE} {
		m, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, flags)
		if err != nil {
			e.t.Fatal(err)
		}
		r, err := e.a.Register(m[4096:8192], all)
		if err == nil {
			r.Deregister()
			e.t.Errorf("a mapping of %s (flags %#x) was registered", f.Name(), flags)
		} else if !errors.Is(err, transport.ErrFileMapping) {
			e.t.Errorf("register a file mapping: %v, want ErrFileMapping", err)
		} else {
			e.t.Logf("refused: %v", err)
		}
		unix.Munmap(m)
	}
	fd, err := unix.MemfdCreate("rblk-test", unix.MFD_CLOEXEC)
	if err != nil {
		e.t.Logf("memfd_create: %v", err)
		return
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, size); err != nil {
		e.t.Fatal(err)
	}
	m, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		e.t.Fatal(err)
	}
	defer unix.Munmap(m)
	r, err := e.a.Register(m, all)
	if errors.Is(err, transport.ErrFileMapping) {
		e.t.Errorf("a memfd mapping was refused as a file: %v", err)
	} else if err != nil {
		e.t.Logf("memfd mapping refused (by the provider, not as a file): %v", err)
	} else if err := r.Deregister(); err != nil {
		e.t.Error(err)
	}
}
