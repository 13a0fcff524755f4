package link

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
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

// TestPostOpsThenDone: WRITEs posted with PostOps are done when a Done
// started after them completes, which gives their send-queue room back:
// rounds of a full send queue of them never wait. A failed one takes the
// link down, and the Done after it calls back with the error.
func TestPostOpsThenDone(t *testing.T) {
	p := newPair(t, 8, 0)
	remote, local := p.regions(t)
	lb := local.Bytes()
	n := p.client.MaxChain()
	ops := make([]Op, n)
	for i := range ops {
		ops[i] = Op{Write: true, Local: transport.SGE{Region: local, Offset: i * 64, Length: 64}, Addr: remote.Addr() + uint64(i*64), RKey: remote.RKey()}
	}
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: uint64(n * 64)}}}
	for round := range 5 {
		for i := range n * 64 {
			lb[i] = byte(round*31 + i)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		// The whole room, in two posts: a wait for room would time out.
		if err := p.client.PostOps(ctx, ops[:n/2]...); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if err := p.client.PostOps(ctx, ops[n/2:]...); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		cancel()
		cb := &chanCallback{ch: make(chan startResult, 1), check: func() bool {
			return bytes.Equal(remote.Bytes()[:n*64], lb[:n*64])
		}}
		if err := p.client.TryStart(cb, done); err != nil {
			t.Fatalf("round %d: TryStart: %v", round, err)
		}
		if r := cb.wait(t); r.err != nil || !r.placed {
			t.Fatalf("round %d: callback err %v, data placed %v", round, r.err, r.placed)
		}
	}
	if err := p.client.PostOps(context.Background(), make([]Op, n+1)...); !errors.Is(err, ErrChainTooLong) {
		t.Fatalf("PostOps of MaxChain+1: %v, want ErrChainTooLong", err)
	}

	// A WRITE the peer refuses (a wrong rkey).
	bad := ops[0]
	bad.RKey++
	if err := p.client.PostOps(context.Background(), bad); err != nil {
		t.Fatal(err)
	}
	cb := &chanCallback{ch: make(chan startResult, 1)}
	if err := p.client.Start(context.Background(), cb, done); err != nil && !errors.Is(err, ErrDown) {
		t.Fatal(err)
	} else if err == nil {
		if r := cb.wait(t); !errors.Is(r.err, ErrDown) {
			t.Fatalf("the Done after a refused WRITE: %v, want ErrDown", r.err)
		}
	}
	select {
	case <-p.client.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a refused WRITE of PostOps did not take the link down")
	}
	if err := p.client.TryStart(cb, done); !errors.Is(err, ErrDown) {
		t.Fatalf("TryStart on a link that is down: %v, want ErrDown", err)
	}
}

// TestTryStartWouldWait: where Start would wait for a credit, TryStart
// posts nothing and says so.
func TestTryStartWouldWait(t *testing.T) {
	release := make(chan struct{})
	got := make(chan struct{}, 4)
	p := newPairWith(t, pairConfig{recvBuffers: 2, server: func(o *Options) {
		// The peer's handler keeps its receive buffers, so no credit
		// comes back.
		o.Handler = func(protocol.Header, []byte) {
			got <- struct{}{}
			<-release
		}
	}})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock) // (before the pair closes)
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 1}}}
	cb := &chanCallback{ch: make(chan startResult, 2)}
	// 2 credits, 1 kept for Credit messages: one Done goes.
	if err := p.client.TryStart(cb, done); err != nil {
		t.Fatal(err)
	}
	<-got
	if err := p.client.TryStart(cb, done); !errors.Is(err, ErrWouldWait) {
		t.Fatalf("TryStart without credits: %v, want ErrWouldWait", err)
	}
	unblock() // (the peer's transport acknowledges the SEND once its handler returned)
	if r := cb.wait(t); r.err != nil {
		t.Fatalf("the Done that went: %v", r.err)
	}
	select {
	case r := <-cb.ch:
		t.Fatalf("the Done that did not go called back: %v", r.err)
	default:
	}
}

// logFlusher records its Flush calls in a shared log.
type logFlusher struct {
	name string
	log  *eventLog
}

func (f *logFlusher) Flush() { f.log.add("flush " + f.name) }

type eventLog struct {
	mu     sync.Mutex
	events []string
	more   chan struct{}
}

func (l *eventLog) add(e string) {
	l.mu.Lock()
	l.events = append(l.events, e)
	l.mu.Unlock()
	l.more <- struct{}{}
}

// deferCallback defers its flushers from OnComplete: a twice, b once.
type deferCallback struct {
	l    *Link
	a, b Flusher
	log  *eventLog
	ok   [3]bool
}

func (c *deferCallback) OnComplete(err error) {
	c.ok = [3]bool{c.l.Defer(c.a), c.l.Defer(c.a), c.l.Defer(c.b)}
	c.log.add(fmt.Sprintf("callback %v", err))
}

// TestDefer: flushers deferred by a callback are flushed after it
// returned, once each however often they were deferred; outside a
// callback Defer refuses and never flushes.
func TestDefer(t *testing.T) {
	p := newPair(t, 8, 0)
	remote, local := p.regions(t)
	log := &eventLog{more: make(chan struct{}, 16)}
	a, b := &logFlusher{"a", log}, &logFlusher{"b", log}
	if p.client.Defer(a) {
		t.Fatal("Defer outside a callback accepted")
	}
	cb := &deferCallback{l: p.client, a: a, b: b, log: log}
	if err := p.client.Start(context.Background(), cb, nil,
		Op{Write: true, Local: transport.SGE{Region: local, Length: 8}, Addr: remote.Addr(), RKey: remote.RKey()}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		select {
		case <-log.more:
		case <-time.After(10 * time.Second):
			t.Fatalf("events so far: %q", log.events)
		}
	}
	log.mu.Lock()
	got := strings.Join(log.events, ", ")
	log.mu.Unlock()
	if want := "callback <nil>, flush a, flush b"; got != want {
		t.Fatalf("events %q, want %q", got, want)
	}
	if cb.ok != [3]bool{true, true, true} {
		t.Fatalf("Defer from the callback reported %v", cb.ok)
	}
}
