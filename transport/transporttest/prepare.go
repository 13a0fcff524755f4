package transporttest

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/rblk/rblk/transport"
)

// RunPrepare runs the tests of ConnRequest.Prepare with p (RunProvider runs
// them too): receives posted on a prepared connection before it is accepted
// are there for the peer's first SENDs, sent as soon as its Dial returns.
// With a provider where a SEND that meets no posted receive fails at once
// (RNR retry 0; the tcp provider with a tiny RNRTimeout) the check is
// strict.
func RunPrepare(t *testing.T, p transport.Provider, addr func(t *testing.T) string) {
	ctx := testContext
	listen := func(t *testing.T) transport.Listener { return listenOn(t, p, addr) }

	t.Run("PrepareBeforeAccept", func(t *testing.T) {
		CheckGoroutines(t)
		l := listen(t)
		e := &env{t: t}
		t.Cleanup(e.free)
		const n, size = 4, 64
		type result struct {
			c   transport.Conn
			src transport.Region
			err error
		}
		dialed := make(chan result, 1)
		go func() {
			c, err := p.Dial(ctx(t), l.Addr(), []byte("dialer"))
			if err != nil {
				dialed <- result{err: err}
				return
			}
			// The first SENDs go at once: the peer's receives were posted
			// before it accepted.
			src, err := e.tryRegion(c, n*size, rw)
			if err == nil {
				for i := range n {
					fill(src.Bytes()[i*size:(i+1)*size], uint64(i+1))
				}
				wrs := make([]transport.WorkRequest, n)
				for i := range wrs {
					wrs[i] = sendWR(uint64(i+1), src, i*size, size)
				}
				err = c.PostSend(wrs...)
			}
			dialed <- result{c, src, err}
		}()
		req, err := l.Accept(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		pc, err := req.Prepare()
		if err != nil {
			t.Fatalf("prepare: %v", err)
		}
		defer pc.Close()
		if again, err := req.Prepare(); err != nil || again != pc {
			t.Errorf("second prepare: %v, %v; want the same conn", again, err)
		}
		if !bytes.Equal(pc.PeerPrivateData(), []byte("dialer")) {
			t.Errorf("prepared conn: peer private data %q", pc.PeerPrivateData())
		}
		dst := e.region(pc, n*size, rw)
		rrs := make([]transport.RecvRequest, n)
		for i := range rrs {
			rrs[i] = recvRR(uint64(10+i), dst, i*size, size)
		}
		e.postRecv(pc, rrs...)
		if err := pc.PostSend(sendWR(99, dst, 0, 1)); !errors.Is(err, transport.ErrNotAccepted) {
			t.Errorf("post send before accept: %v, want ErrNotAccepted", err)
		}
		b, err := req.Accept(ctx(t), []byte("acceptor"))
		if err != nil {
			t.Fatalf("accept after prepare: %v", err)
		}
		defer b.Close()
		if b != pc {
			t.Fatalf("accept returned %v, not the prepared conn %v", b, pc)
		}
		r := <-dialed
		if r.c != nil {
			defer r.c.Close()
		}
		if r.err != nil {
			t.Fatalf("dial and send at once: %v", r.err)
		}
		if got := r.c.PeerPrivateData(); !bytes.Equal(got, []byte("acceptor")) {
			t.Errorf("dialer: peer private data %q", got)
		}
		e.a, e.b = r.c, b
		for i, c := range e.wait(b, n) {
			e.check(c, uint64(10+i), transport.OpRecv, transport.StatusSuccess)
			if c.ByteLen != size || !bytes.Equal(dst.Bytes()[i*size:(i+1)*size], r.src.Bytes()[i*size:(i+1)*size]) {
				t.Errorf("receive %d: %d bytes, or data differs", i, c.ByteLen)
			}
		}
		for i, c := range e.wait(r.c, n) {
			e.check(c, uint64(i+1), transport.OpSend, transport.StatusSuccess)
		}
		// The conn works both ways after that.
		src := e.region(b, size, rw)
		e.a, e.b = b, r.c
		e.notify(src, r.src, 50)
	})

	t.Run("PrepareThenReject", func(t *testing.T) {
		CheckGoroutines(t)
		l := listen(t)
		e := &env{t: t}
		t.Cleanup(e.free)
		errc := make(chan error, 1)
		go func() {
			c, err := p.Dial(ctx(t), l.Addr(), nil)
			if c != nil {
				c.Close()
			}
			errc <- err
		}()
		req, err := l.Accept(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		pc, err := req.Prepare()
		if err != nil {
			t.Fatalf("prepare: %v", err)
		}
		defer pc.Close()
		dst := e.region(pc, 128, rw)
		e.postRecv(pc, recvRR(1, dst, 0, 64), recvRR(2, dst, 64, 64))
		if err := req.Reject([]byte("no")); err != nil {
			t.Fatalf("reject after prepare: %v", err)
		}
		var rej *transport.RejectError
		if err := <-errc; !errors.As(err, &rej) || string(rej.PrivateData) != "no" {
			t.Errorf("dial: %v, want a *RejectError with %q", err, "no")
		}
		e.a = pc
		got := e.drain(pc)
		if len(got) != 2 {
			t.Fatalf("completions of the rejected conn: %+v, want its 2 receives flushed", got)
		}
		for i, c := range got {
			e.check(c, uint64(i+1), transport.OpRecv, transport.StatusFlushed)
		}
		if _, err := req.Accept(ctx(t), nil); err == nil {
			t.Error("accepting a rejected request succeeded")
		}
	})
}

// free frees the memory of e's regions after closing its conns.
func (e *env) free() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, c := range []transport.Conn{e.a, e.b} {
		if c != nil {
			c.Close()
		}
	}
	for _, m := range e.mems {
		m.Free()
	}
}

// tryRegion is region for goroutines other than the test's: it returns
// the error.
func (e *env) tryRegion(c transport.Conn, size int, access transport.Access) (transport.Region, error) {
	m, err := transport.AllocMemory(size, false)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	e.mems = append(e.mems, m)
	e.mu.Unlock()
	r, err := c.Register(m.Bytes()[:size], access)
	if err != nil {
		return nil, fmt.Errorf("register %d bytes: %w", size, err)
	}
	return r, nil
}
