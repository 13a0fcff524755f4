package link

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
)

// postCounter counts the link's calls to PostSend (Options.Posts).
type postCounter struct{ n atomic.Int64 }

func (c *postCounter) Inc() { c.n.Add(1) }

// TestPlug: what is started while the link is plugged reaches the
// connection only at Unplug, all of it in one PostSend and in the order
// posted (WRITEs of PostOps before the Done that reports them), and then
// completes.
func TestPlug(t *testing.T) {
	var posts postCounter
	p := newPairWith(t, pairConfig{recvBuffers: 8, client: func(o *Options) { o.Posts = &posts }})
	remote, local := p.regions(t)
	lb := local.Bytes()
	for i := range 4 * 4096 {
		lb[i] = byte(i*13 + 5)
	}
	op := func(i int) Op {
		return Op{Write: true, Local: transport.SGE{Region: local, Offset: i * 4096, Length: 4096}, Addr: remote.Addr() + uint64(i*4096), RKey: remote.RKey()}
	}
	placed := func(i int) func() bool {
		return func() bool { return bytes.Equal(remote.Bytes()[i*4096:(i+1)*4096], lb[i*4096:(i+1)*4096]) }
	}
	done := func(i int) *protocol.Done {
		return &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: uint64(i * 4096), Length: 4096}}}
	}
	before := posts.n.Load()
	dones := p.dones.Load()

	p.client.Plug()
	var cbs []*chanCallback
	for i := range 3 {
		cb := &chanCallback{ch: make(chan startResult, 1), check: placed(i)}
		cbs = append(cbs, cb)
		if err := p.client.Start(context.Background(), cb, done(i), op(i)); err != nil {
			t.Fatal(err)
		}
	}
	// A write whose Done goes apart, after its WRITE (PostOps).
	if err := p.client.PostOps(context.Background(), op(3)); err != nil {
		t.Fatal(err)
	}
	last := &chanCallback{ch: make(chan startResult, 1), check: placed(3)}
	if err := p.client.TryStart(last, done(3)); err != nil {
		t.Fatal(err)
	}
	if got := posts.n.Load() - before; got != 0 {
		t.Fatalf("plugged: %d PostSend calls, want 0", got)
	}
	p.client.Unplug()
	if got := posts.n.Load() - before; got != 1 {
		t.Fatalf("Unplug: %d PostSend calls, want 1", got)
	}
	for i, cb := range append(cbs, last) {
		if r := cb.wait(t); r.err != nil || !r.placed {
			t.Fatalf("chain %d: callback err %v, data placed %v", i, r.err, r.placed)
		}
	}
	waitFor(t, "the peer's 4 Dones", func() bool { return p.dones.Load() == dones+4 })

	// Unplugged, each Start posts at once.
	before = posts.n.Load()
	cb := &chanCallback{ch: make(chan startResult, 1), check: placed(0)}
	if err := p.client.Start(context.Background(), cb, done(0), op(0)); err != nil {
		t.Fatal(err)
	}
	if got := posts.n.Load() - before; got != 1 {
		t.Fatalf("unplugged Start: %d PostSend calls, want 1", got)
	}
	if r := cb.wait(t); r.err != nil || !r.placed {
		t.Fatalf("unplugged chain: callback err %v, data placed %v", r.err, r.placed)
	}
}

// TestPlugWaitUnplugs: a call that must wait unplugs the link first, since
// what it waits for may be held back: a Start with no credit left (the
// credits come back only once the Dones held back reach the peer), and a
// Request, whose reply comes only once it is sent. Without that, both
// would wait forever.
func TestPlugWaitUnplugs(t *testing.T) {
	p := newPair(t, 4, 0)
	remote, local := p.regions(t)
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 64}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	p.client.Plug()
	// 4 credits, 1 kept for Credit messages: the fourth Start waits.
	var cbs []*chanCallback
	for i := range 6 {
		cb := &chanCallback{ch: make(chan startResult, 1)}
		cbs = append(cbs, cb)
		if err := p.client.Start(ctx, cb, done,
			Op{Write: true, Local: transport.SGE{Region: local, Offset: 0, Length: 64}, Addr: remote.Addr(), RKey: remote.RKey()}); err != nil {
			t.Fatalf("Start %d: %v", i, err)
		}
	}
	for i, cb := range cbs[:3] {
		if r := cb.wait(t); r.err != nil {
			t.Fatalf("chain %d: %v", i, r.err)
		}
	}
	// The wait unplugged the link: the Starts after it posted at once.
	for i, cb := range cbs[3:] {
		if r := cb.wait(t); r.err != nil {
			t.Fatalf("chain %d: %v", 3+i, r.err)
		}
	}

	p.client.Plug()
	cb := &chanCallback{ch: make(chan startResult, 1)}
	if err := p.client.Start(ctx, cb, done); err != nil {
		t.Fatal(err)
	}
	err := p.client.Request(ctx, &protocol.Open{Name: "nope", Mode: protocol.ModeReadWrite}, &protocol.VolumeInfo{})
	var re *protocol.RemoteError
	if !errors.As(err, &re) {
		t.Fatalf("Request while plugged: %v, want the peer's error reply", err)
	}
	if r := cb.wait(t); r.err != nil {
		t.Fatalf("the Done started before the Request: %v", r.err)
	}
}

// TestPlugLinkDown: chains held back by a plug when the link goes down
// are never posted; their callbacks get the link's error once it closed,
// and Plug and Unplug on a link that is down do nothing.
func TestPlugLinkDown(t *testing.T) {
	var posts postCounter
	p := newPairWith(t, pairConfig{recvBuffers: 8, client: func(o *Options) { o.Posts = &posts }})
	remote, local := p.regions(t)
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 64}}}
	p.client.Plug()
	cb := &chanCallback{ch: make(chan startResult, 1)}
	if err := p.client.Start(context.Background(), cb, done,
		Op{Write: true, Local: transport.SGE{Region: local, Offset: 0, Length: 64}, Addr: remote.Addr(), RKey: remote.RKey()}); err != nil {
		t.Fatal(err)
	}
	before := posts.n.Load()
	p.client.Close()
	if r := cb.wait(t); !errors.Is(r.err, ErrDown) {
		t.Fatalf("callback of a chain held back when the link closed: %v, want ErrDown", r.err)
	}
	p.client.Unplug()
	p.client.Plug()
	p.client.Unplug()
	if got := posts.n.Load() - before; got != 0 {
		t.Fatalf("%d PostSend calls after the link closed, want 0", got)
	}
}

// refusingProvider dials connections whose PostSend fails once refuse is
// set, as a connection the device broke under does.
type refusingProvider struct {
	transport.Provider
	refuse atomic.Bool
}

func (p *refusingProvider) Dial(ctx context.Context, addr string, pd []byte) (transport.Conn, error) {
	return wrapDial(ctx, p.Provider, addr, pd, func(c transport.Conn) transport.Conn { return &refusingConn{Conn: c, p: p} })
}

type refusingConn struct {
	transport.Conn
	p *refusingProvider
}

func (c *refusingConn) PostSend(wrs ...transport.WorkRequest) error {
	if c.p.refuse.Load() {
		return errors.New("injected: post send refused")
	}
	return c.Conn.PostSend(wrs...)
}

// TestPlugUnplugRefused: when the connection refuses what Unplug hands
// it, the link goes down, the chains it held fail with ErrDown once it
// closed, and nothing of them reached the peer.
func TestPlugUnplugRefused(t *testing.T) {
	rp := &refusingProvider{Provider: tcp.New("tcp")}
	p := newPairWith(t, pairConfig{recvBuffers: 8, provider: rp})
	remote, local := p.regions(t)
	done := &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 64}}}
	dones := p.dones.Load()
	p.client.Plug()
	cb := &chanCallback{ch: make(chan startResult, 1)}
	if err := p.client.Start(context.Background(), cb, done,
		Op{Write: true, Local: transport.SGE{Region: local, Offset: 0, Length: 64}, Addr: remote.Addr(), RKey: remote.RKey()}); err != nil {
		t.Fatal(err)
	}
	rp.refuse.Store(true)
	p.client.Unplug()
	select {
	case <-p.client.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a refused Unplug did not take the link down")
	}
	if err := p.client.Err(); err == nil || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("link error %v, want the refusal", err)
	}
	p.client.Close()
	if r := cb.wait(t); !errors.Is(r.err, ErrDown) {
		t.Fatalf("callback of a chain whose post was refused: %v, want ErrDown", r.err)
	}
	if got := p.dones.Load(); got != dones {
		t.Fatalf("the peer got %d Dones of a chain never posted", got-dones)
	}
}
