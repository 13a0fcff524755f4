package faultnet_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

func addr(*testing.T) string { return "127.0.0.1:0" }

// TestTransparent: without faults the wrapper passes the conformance suite.
func TestTransparent(t *testing.T) {
	transporttest.RunProvider(t, faultnet.Wrap(tcp.New("tcp")), addr)
}

func pair(t *testing.T) (fn *faultnet.Provider, a, b *faultnet.Conn) {
	fn = faultnet.Wrap(tcp.New("tcp"))
	ca, cb := transporttest.Connect(t, fn, "127.0.0.1:0")
	a, b = ca.(*faultnet.Conn), cb.(*faultnet.Conn)
	if conns := fn.Conns(); len(conns) != 2 {
		t.Fatalf("%d conns tracked, want 2", len(conns))
	}
	return fn, a, b
}

func TestDisconnect(t *testing.T) {
	transporttest.CheckGoroutines(t)
	_, a, b := pair(t)
	ra, err := a.Register(make([]byte, 64), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := b.Register(make([]byte, 64), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.PostRecv(transport.RecvRequest{ID: 1, Local: transport.SGE{Region: ra, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	if err := b.PostRecv(transport.RecvRequest{ID: 2, Local: transport.SGE{Region: rb, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	a.Disconnect()
	if !a.Disconnected() || b.Disconnected() {
		t.Error("Disconnected() is wrong")
	}
	for _, c := range []*faultnet.Conn{a, b} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		out := make([]transport.Completion, 4)
		n, err := c.Poll(ctx, out)
		if err != nil || n != 1 || out[0].Status != transport.StatusFlushed {
			t.Errorf("first poll after disconnect: %d %+v %v, want the receive flushed", n, out[:n], err)
		}
		if _, err := c.Poll(ctx, out); !errors.Is(err, transport.ErrClosed) {
			t.Errorf("poll after disconnect: %v, want ErrClosed", err)
		}
		cancel()
	}
	if err := a.Close(); err != nil {
		t.Errorf("close after disconnect: %v", err)
	}
}

func TestDelay(t *testing.T) {
	transporttest.CheckGoroutines(t)
	_, a, b := pair(t)
	ra, _ := a.Register(make([]byte, 64), transport.AccessLocalWrite)
	rb, _ := b.Register(make([]byte, 64), transport.AccessLocalWrite)
	if err := b.PostRecv(transport.RecvRequest{ID: 2, Local: transport.SGE{Region: rb, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	const d = 100 * time.Millisecond
	a.Delay(d)
	start := time.Now()
	if err := a.PostSend(transport.WorkRequest{ID: 1, Op: transport.OpSend, Local: transport.SGE{Region: ra, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	out := make([]transport.Completion, 1)
	// A poll whose context ends during the delay keeps the completion.
	short, cancel := context.WithTimeout(context.Background(), d/4)
	if _, err := a.Poll(short, out); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("short poll: %v, want deadline exceeded", err)
	}
	cancel()
	if n, err := a.Poll(context.Background(), out); err != nil || n != 1 || out[0].ID != 1 {
		t.Fatalf("poll: %d %+v %v", n, out, err)
	}
	// The peer is not delayed.
	if n, err := b.Poll(context.Background(), out); err != nil || n != 1 || out[0].ID != 2 {
		t.Fatalf("peer poll: %d %+v %v", n, out, err)
	}
	if el := time.Since(start); el < d/4 {
		t.Errorf("completion after %v, want it delayed", el)
	}
	a.Delay(0)
	if err := b.PostRecv(transport.RecvRequest{ID: 3, Local: transport.SGE{Region: rb, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	if err := a.PostSend(transport.WorkRequest{ID: 4, Op: transport.OpSend, Local: transport.SGE{Region: ra, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if n, err := a.Poll(context.Background(), out); err != nil || n != 1 || out[0].ID != 4 {
		t.Fatalf("poll: %d %+v %v", n, out, err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("undelayed completion took %v", el)
	}
}
