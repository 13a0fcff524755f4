package link

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// stalledServer returns a pair whose server stops processing completions
// (a peer whose process hangs, or a path that stops delivering) once the
// returned function is called.
func stalledServer(t *testing.T, client func(*Options)) (*pair, func()) {
	t.Helper()
	fp := faultnet.Wrap(tcp.New("tcp"))
	p := newPairWith(t, pairConfig{recvBuffers: 8, provider: fp, client: client})
	return p, func() {
		for _, c := range fp.Conns() {
			if transport.Conn(c) != p.client.Conn() {
				c.Delay(time.Hour)
			}
		}
	}
}

// faultConnOf returns l's connection of fp's, whose completions the test
// can hold.
func faultConnOf(t *testing.T, fp *faultnet.Provider, l *Link) *faultnet.Conn {
	t.Helper()
	for _, c := range fp.Conns() {
		if transport.Conn(c) == l.Conn() {
			return c
		}
	}
	t.Fatal("the link's connection is not one of the faultnet provider's")
	return nil
}

// TestKeepAliveDetectsSilentPeer: a peer that stops answering is detected
// within the keepalive timeout, and the link goes down with ErrTimeout.
func TestKeepAliveDetectsSilentPeer(t *testing.T) {
	const ka = 600 * time.Millisecond
	// The link counts silence from the last frame it received, which may
	// come before the stall (the pair's setup, a keepalive answered): the
	// earliest it may be declared dead is ka after the pair was made.
	start := time.Now()
	p, stall := stalledServer(t, func(o *Options) { o.KeepAlive = ka })
	stall()
	select {
	case <-p.client.Done():
	case <-time.After(10 * ka):
		t.Fatalf("link still up %v after the peer went silent (keepalive %v)", 10*ka, ka)
	}
	if err := p.client.Err(); !errors.Is(err, ErrTimeout) || !errors.Is(err, ErrDown) {
		t.Fatalf("link down with %v, want ErrTimeout", err)
	}
	if took := time.Since(start); took < ka {
		t.Fatalf("declared dead %v after the pair was made, before the keepalive timeout %v", took, ka)
	}
}

// TestTimeoutLogsLinkState: the log line of a link that timed out says
// what state its flow control was in (so that a stall in the field tells a
// silent peer from a credit deadlock or a transport whose completions
// stopped), and when it last heard from the peer.
func TestTimeoutLogsLinkState(t *testing.T) {
	const ka = 600 * time.Millisecond
	core, logs := observer.New(zap.WarnLevel)
	p, stall := stalledServer(t, func(o *Options) { o.KeepAlive = ka; o.Logger = zap.New(core) })
	stall()
	select {
	case <-p.client.Done():
	case <-time.After(10 * ka):
		t.Fatalf("link still up %v after the peer went silent (keepalive %v)", 10*ka, ka)
	}
	entries := logs.FilterMessage("peer timed out, closing the link").All()
	if len(entries) != 1 {
		t.Fatalf("%d log lines \"peer timed out, closing the link\", want 1 (all: %v)", len(entries), logs.All())
	}
	state, ok := entries[0].ContextMap()["link"].(map[string]any)
	if !ok {
		t.Fatalf("log line without the link's state: %v", entries[0].ContextMap())
	}
	// 8 receive buffers at the server: the client's credits were its 8 less
	// what went out unanswered (pings), and its send slots (as many) free
	// once those SENDs completed.
	if c, ok := state["peer_credits"].(int64); !ok || c < 0 || c >= 8 {
		t.Errorf("peer_credits = %v, want 0 to 7 (pings went out)", state["peer_credits"])
	}
	var free, slots int
	if s, ok := state["send_slots_free"].(string); !ok {
		t.Errorf("send_slots_free = %v, want free/total", state["send_slots_free"])
	} else if _, err := fmt.Sscanf(s, "%d/%d", &free, &slots); err != nil || free < 0 || free > slots || slots != 8 {
		t.Errorf("send_slots_free = %q, want n/8", s)
	}
	if d, ok := state["since_last_recv"].(time.Duration); !ok || d < ka {
		t.Errorf("since_last_recv = %v, want at least the keepalive timeout %v", state["since_last_recv"], ka)
	}
	for _, k := range []string{"credits_to_return", "sq_room", "requests_waiting", "rdma_batches", "pongs_owed", "pinging", "plugged"} {
		if _, ok := state[k]; !ok {
			t.Errorf("link state without %s: %v", k, state)
		}
	}
}

// TestKeepAliveKeepsQuietLinkUp: a quiet link whose peer answers stays up
// however long it is quiet, on both sides.
func TestKeepAliveKeepsQuietLinkUp(t *testing.T) {
	const ka = 300 * time.Millisecond
	p := newPairWith(t, pairConfig{recvBuffers: 4,
		client: func(o *Options) { o.KeepAlive = ka },
		server: func(o *Options) { o.KeepAlive = ka }})
	// The stimulus is quiet time itself: many keepalive periods.
	select {
	case <-p.client.Done():
		t.Fatalf("client link went down while quiet: %v", p.client.Err())
	case <-p.server.Done():
		t.Fatalf("server link went down while quiet: %v", p.server.Err())
	case <-time.After(12 * ka):
	}
	var g protocol.Grant
	if err := p.client.Request(context.Background(), &protocol.GrantRequest{Handle: 1}, &g); err != nil {
		t.Fatalf("request after a quiet while: %v", err)
	}
}

// TestRequestTimeout: a request the peer never answers takes the link down
// after Options.RequestTimeout, and so does an RDMA operation that never
// completes; RequestWithin overrides the timeout.
func TestRequestTimeout(t *testing.T) {
	const rt = 300 * time.Millisecond
	p, stall := stalledServer(t, func(o *Options) { o.RequestTimeout = rt })
	stall()
	start := time.Now()
	err := p.client.Request(context.Background(), &protocol.GrantRequest{Handle: 1}, &protocol.Grant{})
	if !errors.Is(err, ErrTimeout) {
		t.Fatalf("request to a silent peer: %v, want ErrTimeout", err)
	}
	if took := time.Since(start); took < rt || took > 20*rt {
		t.Fatalf("request timed out after %v, want about %v", took, rt)
	}
	select {
	case <-p.client.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("link still up after a request timed out")
	}
}

// TestRDMATimeout: RDMA operations that never complete end with ErrTimeout.
func TestRDMATimeout(t *testing.T) {
	const rt = 300 * time.Millisecond
	p, stall := stalledServer(t, func(o *Options) { o.RequestTimeout = rt })
	mem, err := transport.AllocMemory(1<<16, false)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	local, err := p.client.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Deregister()
	// The client's own completions are held: its READs never complete.
	p.client.Conn().(*faultnet.Conn).Delay(time.Hour)
	stall()
	err = p.client.RDMA(context.Background(), Op{Local: transport.SGE{Region: local, Length: 8}, Addr: 1, RKey: 2})
	if !errors.Is(err, ErrDown) {
		t.Fatalf("RDMA that never completes: %v, want the link down", err)
	}
	if lerr := p.client.Err(); !errors.Is(lerr, ErrTimeout) {
		t.Fatalf("link down with %v, want ErrTimeout", lerr)
	}
}

// TestSendQueueAdmission: RDMA chains from many goroutines, some longer
// than the send queue, and SENDs between them never meet a full queue: no
// error, the link stays up (before, the chain failed with ErrQueueFull and
// a SEND meeting a full queue took the link down).
func TestSendQueueAdmission(t *testing.T) {
	p := newPairWith(t, pairConfig{recvBuffers: 8, provider: tcp.NewWithOptions("tcp", tcp.Options{SendQueueDepth: 32})})
	remote, local := p.regions(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 10 + 9*w // 10 to 73 operations: some longer than the queue
			ops := make([]Op, n)
			for i := range ops {
				off := (w*100 + i) * 64
				ops[i] = Op{Write: i%2 == 0, Local: transport.SGE{Region: local, Offset: off, Length: 64},
					Addr: remote.Addr() + uint64(off), RKey: remote.RKey()}
			}
			for range 30 {
				if err := p.client.RDMA(ctx, ops...); err != nil {
					errs <- err
					return
				}
				d := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 64}}}
				if err := p.client.Send(ctx, 0, d); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("under a full send queue: %v", err)
	}
	if err := p.client.Err(); err != nil {
		t.Fatalf("link went down: %v", err)
	}
	// Every Done arrives: the server handler counts them.
	deadline := time.Now().Add(10 * time.Second)
	for p.dones.Load() < 8*30 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d Dones arrived", p.dones.Load(), 8*30)
		}
		time.Sleep(time.Millisecond) // polling for the count, bounded by the deadline
	}
}

// TestSendRacingClose: a sender that got its send slot just before the
// link went down and was closed must not write into the send buffers Close
// freed (before, it encoded its message into unmapped memory and the
// process died with SIGSEGV, seen in rblk-attach when a connection broke).
func TestSendRacingClose(t *testing.T) {
	p := newPair(t, 8, 0)
	testHookAcquired = func(l *Link) {
		if l == p.client {
			l.Close() // frees the send buffers
		}
	}
	defer func() { testHookAcquired = nil }()
	d := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 1}}}
	if err := p.client.Send(context.Background(), 0, d); !errors.Is(err, ErrDown) {
		t.Fatalf("send on a link closed after its slot was taken: %v, want ErrDown", err)
	}
}

// TestPongWaitingForCreditDoesNotHoldCredits: a KeepAlive that cannot be
// answered yet (this side spent its credits, down to the one kept for
// Credit messages) must not hold back the Credit message that returns the
// peer its credits: if it did, and the peer's answer waited the same way,
// neither side could send again until a keepalive took the link down.
func TestPongWaitingForCreditDoesNotHoldCredits(t *testing.T) {
	fp := faultnet.Wrap(tcp.New("tcp"))
	p := newPairWith(t, pairConfig{recvBuffers: 8, provider: fp})
	client := faultConnOf(t, fp, p.client)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 1}}}
	// The client takes in nothing for now: the server spends its credits
	// (8, one kept) on messages the client does not see.
	client.Hold()
	for i := range 7 {
		if err := p.server.Send(ctx, 0, done); err != nil {
			t.Fatalf("server message %d: %v", i+1, err)
		}
	}
	// The client asks whether the server is alive: the server owes an OK
	// it has no credit for.
	pong := make(chan error, 1)
	go func() { pong <- p.client.RequestWithin(ctx, 0, &protocol.KeepAlive{}, &protocol.OK{}) }()
	waitFor(t, "the server to owe a pong", func() bool {
		p.server.mu.Lock()
		defer p.server.mu.Unlock()
		return len(p.server.pongs) == 1 || p.server.credits <= 1 && p.server.toReturn > 0
	})
	// The client sends on: the server re-posts half its buffers and must
	// return them with a Credit message, its pong still waiting.
	for i := range 4 {
		if err := p.client.Send(ctx, 0, done); err != nil {
			t.Fatalf("client message %d: %v", i+1, err)
		}
	}
	// Only a Credit message may spend the credit kept in reserve (the
	// pong waits for one above it), so the server's last credit gone is
	// its Credit message posted. (Its count of buffers to return is no
	// sign: the Credit message may leave before the last of the four
	// arrive, and what they add then waits for a credit.)
	waitFor(t, "the server to return its re-posted buffers (a Credit message) while its pong waits for a credit", func() bool {
		p.server.mu.Lock()
		defer p.server.mu.Unlock()
		return p.server.credits == 0
	})
	client.Release()
	if err := <-pong; err != nil {
		t.Fatalf("KeepAlive: %v, want OK once the client took in what was held", err)
	}
}

// TestKeepAliveFloodBounded: a peer that sends KeepAlive requests without
// waiting for their answers, while this side cannot answer (no credit),
// gets the link closed after maxPongsOwed of them, not a queue that grows
// with every one.
func TestKeepAliveFloodBounded(t *testing.T) {
	const buffers = 32
	fp := faultnet.Wrap(tcp.New("tcp"))
	p := newPairWith(t, pairConfig{recvBuffers: buffers, provider: fp})
	client := faultConnOf(t, fp, p.client)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 1}}}
	client.Hold()
	defer client.Release()
	for i := range buffers - 1 {
		if err := p.server.Send(ctx, 0, done); err != nil {
			t.Fatalf("server message %d: %v", i+1, err)
		}
	}
	// One answer waits for a credit, maxPongsOwed more are queued, and the
	// next is one too many.
	for i := range maxPongsOwed + 2 {
		if err := p.client.Send(ctx, uint64(1000+i), &protocol.KeepAlive{}); err != nil {
			t.Fatalf("KeepAlive %d: %v", i+1, err)
		}
	}
	select {
	case <-p.server.Done():
	case <-time.After(5 * time.Second):
		p.server.mu.Lock()
		owed := len(p.server.pongs)
		p.server.mu.Unlock()
		t.Fatalf("server link still up after %d KeepAlive requests it could not answer (%d queued)", maxPongsOwed+2, owed)
	}
	if err := p.server.Err(); !errors.Is(err, protocol.ErrProtocol) || !strings.Contains(err.Error(), "KeepAlive requests unanswered") {
		t.Fatalf("server link down with %v, want a protocol error about unanswered KeepAlive requests", err)
	}
}
