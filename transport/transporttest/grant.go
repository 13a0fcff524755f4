package transporttest

import (
	"context"
	"errors"
	"testing"

	"github.com/rblk/rblk/transport"
)

// GrantSize is the span one grant gives the peer in the grant benchmarks
// (a chunk of the target's cache).
const GrantSize = 1 << 20

// BenchGrantRegister measures granting a chunk the way without memory
// windows: Register GrantSize bytes of AllocMemory with remote access on
// c, then Deregister them; one op is both.
func BenchGrantRegister(b *testing.B, c transport.Conn) {
	m, err := transport.AllocMemory(GrantSize, false)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Free()
	buf := m.Bytes()
	clear(buf) // (the pages are touched, as a cache's are)
	const access = transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite
	b.ResetTimer()
	for range b.N {
		r, err := c.Register(buf, access)
		if err != nil {
			b.Fatal(err)
		}
		if err := r.Deregister(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchGrantWindow measures granting a chunk with a memory window: the
// memory is registered once (for windows), and one op is a BindWindow of
// GrantSize bytes of it and its Invalidate, while a goroutine polls c as
// the link does. It skips if c has no memory windows.
func BenchGrantWindow(b *testing.B, c transport.Conn) {
	wb, ok := c.(transport.WindowBinder)
	if !ok {
		b.Skipf("%T has no memory windows", c)
	}
	m, err := transport.AllocMemory(4*GrantSize, false)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Free()
	clear(m.Bytes())
	r, err := c.Register(m.Bytes(), transport.AccessLocalWrite|transport.AccessBindWindow)
	if err != nil {
		b.Fatal(err)
	}
	defer r.Deregister()
	ctx, cancel := context.WithCancel(context.Background())
	polled := make(chan error, 1)
	go func() {
		out := make([]transport.Completion, 16)
		for {
			n, err := c.Poll(ctx, out)
			if err != nil {
				polled <- err
				return
			}
			if n > 0 {
				polled <- errors.New("the poller got a completion: a window request leaked into Poll")
				return
			}
		}
	}()
	defer func() {
		cancel()
		if err := <-polled; !errors.Is(err, context.Canceled) {
			b.Error(err)
		}
	}()
	b.ResetTimer()
	for i := range b.N {
		w, err := wb.BindWindow(ctx, r, (i%4)*GrantSize, GrantSize, transport.AccessRemoteRead|transport.AccessRemoteWrite)
		if errors.Is(err, transport.ErrUnsupported) {
			b.Skipf("no memory windows: %v", err)
		}
		if err != nil {
			b.Fatal(err)
		}
		if err := w.Invalidate(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
}
