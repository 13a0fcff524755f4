package link

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
)

// chanCallback is a Callback that hands its result, and what it saw of
// the peer's memory when it ran, to a channel.
type chanCallback struct {
	check func() bool
	ch    chan startResult
}

type startResult struct {
	err    error
	placed bool
}

func (c *chanCallback) OnComplete(err error) {
	placed := true
	if c.check != nil {
		placed = c.check()
	}
	c.ch <- startResult{err, placed}
}

func (c *chanCallback) wait(t *testing.T) startResult {
	t.Helper()
	select {
	case r := <-c.ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("Start's callback was not called")
		return startResult{}
	}
}

// TestStartWriteThenDone: a chain of WRITEs ended by a Done completes once
// the Done's SEND did, and then the data is in the peer's memory (RC
// ordering), and the peer gets the Done.
func TestStartWriteThenDone(t *testing.T) {
	p := newPair(t, 8, 0)
	remote, local := p.regions(t)
	lb := local.Bytes()
	for i := range 3 * 4096 {
		lb[i] = byte(i*7 + 1)
	}
	ops := []Op{
		{Write: true, Local: transport.SGE{Region: local, Offset: 0, Length: 4096}, Addr: remote.Addr(), RKey: remote.RKey()},
		{Write: true, Local: transport.SGE{Region: local, Offset: 4096, Length: 4096}, Addr: remote.Addr() + 4096, RKey: remote.RKey()},
		{Write: true, Local: transport.SGE{Region: local, Offset: 8192, Length: 4096}, Addr: remote.Addr() + 8192, RKey: remote.RKey()},
	}
	cb := &chanCallback{ch: make(chan startResult, 1), check: func() bool {
		return bytes.Equal(remote.Bytes()[:3*4096], lb[:3*4096])
	}}
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 3 * 4096}}}
	for round := range 50 { // reuse of batches and slots
		if err := p.client.Start(context.Background(), cb, done, ops...); err != nil {
			t.Fatal(err)
		}
		if r := cb.wait(t); r.err != nil || !r.placed {
			t.Fatalf("round %d: callback err %v, data placed %v", round, r.err, r.placed)
		}
	}
	waitFor(t, "the peer's 50 Dones", func() bool { return p.dones.Load() == 50 })

	// Reads only: the last READ is the signaled one.
	copy(remote.Bytes()[20000:], "read me back")
	rd := &chanCallback{ch: make(chan startResult, 1), check: func() bool {
		return string(lb[30000:30012]) == "read me back"
	}}
	if err := p.client.Start(context.Background(), rd, nil,
		Op{Local: transport.SGE{Region: local, Offset: 30000, Length: 4}, Addr: remote.Addr() + 20000, RKey: remote.RKey()},
		Op{Local: transport.SGE{Region: local, Offset: 30004, Length: 8}, Addr: remote.Addr() + 20004, RKey: remote.RKey()}); err != nil {
		t.Fatal(err)
	}
	if r := rd.wait(t); r.err != nil || !r.placed {
		t.Fatalf("reads: callback err %v, data placed %v", r.err, r.placed)
	}
}

// TestStartFailure: a chain whose operation the peer refuses calls back
// with an error that took the link down; a Start on a link that is down
// fails and never calls back; a chain too long is refused.
func TestStartFailure(t *testing.T) {
	p := newPair(t, 8, 0)
	remote, local := p.regions(t)
	if _, err := func() (int, error) {
		ops := make([]Op, p.client.MaxChain()+1)
		return 0, p.client.Start(context.Background(), &chanCallback{ch: make(chan startResult, 1)}, nil, ops...)
	}(); !errors.Is(err, ErrChainTooLong) {
		t.Fatalf("chain of MaxChain+1: %v, want ErrChainTooLong", err)
	}
	cb := &chanCallback{ch: make(chan startResult, 1)}
	err := p.client.Start(context.Background(), cb, &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 1}}},
		Op{Write: true, Local: transport.SGE{Region: local, Offset: 0, Length: 8}, Addr: remote.Addr(), RKey: remote.RKey() + 1},
		Op{Write: true, Local: transport.SGE{Region: local, Offset: 0, Length: 8}, Addr: remote.Addr(), RKey: remote.RKey()})
	if err != nil {
		t.Fatal(err)
	}
	if r := cb.wait(t); !errors.Is(r.err, ErrDown) {
		t.Fatalf("callback: %v, want ErrDown", r.err)
	}
	<-p.client.Done()
	never := &chanCallback{ch: make(chan startResult, 1)}
	if err := p.client.Start(context.Background(), never, nil,
		Op{Local: transport.SGE{Region: local, Offset: 0, Length: 8}, Addr: remote.Addr(), RKey: remote.RKey()}); !errors.Is(err, ErrDown) {
		t.Fatalf("Start on a link that is down: %v, want ErrDown", err)
	}
	p.client.Close()
	select {
	case r := <-never.ch:
		t.Fatalf("callback of a Start that failed was called: %v", r.err)
	default:
	}
}
