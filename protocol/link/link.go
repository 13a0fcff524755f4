package link

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
)

// Handler receives the messages that are not replies to this side's requests.
// It runs on the link's completion goroutine: it must not block and must not
// call Link methods that wait (Request, Send, Reply); it starts a goroutine
// for anything that does. payload is only valid during the call.
type Handler func(h protocol.Header, payload []byte)

// Options configure a Link.
type Options struct {
	// Handler receives requests and one-way messages from the peer. Required.
	Handler Handler
	// RecvBuffers is how many receive buffers this side posts: the credits
	// the peer starts with. Default 128.
	RecvBuffers int
	// SendBuffers is how many control messages may be in flight. Default
	// 128, at most half the connection's send queue: that many entries of
	// the send queue are kept for control messages, and RDMA operations
	// share the rest.
	SendBuffers int
	// KeepAlive, if positive, is the longest the link may go without
	// hearing from its peer: after KeepAlive/3 of quiet it sends a
	// KeepAlive request (answered OK by the peer's link), and after
	// KeepAlive it declares the link dead (ErrTimeout) and closes the
	// connection. Zero disables it.
	KeepAlive time.Duration
	// RequestTimeout, if positive, bounds how long Request waits for a reply
	// and RDMA for its completions: a peer that does not answer in time
	// takes the link down (ErrTimeout), as an NVMe host resets a controller
	// whose command timed out. RequestWithin overrides it per request.
	// Zero: no bound but the caller's context.
	RequestTimeout time.Duration
	// Logger gets one line per link event. Default: no logs.
	Logger *zap.Logger
	// Posts, if not nil, counts the calls that hand work requests to the
	// connection (transport.Conn.PostSend): on RDMA, one doorbell each.
	// Plugging (Plug) makes one call carry the requests of many.
	Posts Counter
}

// Counter counts events (a prometheus.Counter is one).
type Counter interface{ Inc() }

func (o *Options) setDefaults() {
	if o.RecvBuffers <= 0 {
		o.RecvBuffers = 128
	}
	if o.SendBuffers <= 0 {
		o.SendBuffers = 128
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
}

// Errors of a Link.
var (
	// ErrDown is returned by every call once the link broke or was closed.
	ErrDown = errors.New("link down")
	// ErrUnexpectedReply is returned by Request when the reply has the wrong type.
	ErrUnexpectedReply = errors.New("unexpected reply type")
	// ErrTimeout is why a link went down when its peer was silent for
	// longer than Options.KeepAlive, or did not answer a request or
	// complete an RDMA operation within its timeout. It comes wrapped in
	// ErrDown.
	ErrTimeout = errors.New("peer timed out")
)

// wrid kinds, in the top byte of a work request ID. An RDMA operation's ID
// also carries its batch (bits 8-55) and, in its low byte, how many of the
// batch's work requests its completion covers: the count of its piece for
// the signaled last one, 0 for the unsignaled ones before it, whose
// completions come only when they fail.
const (
	kindRecv = 1 << 56
	kindSend = 2 << 56
	kindRDMA = 3 << 56
	kindMask = 0xff << 56

	// maxPiece is the most work requests one signaled completion covers.
	maxPiece = 0xff
)

// Callback is told the end of the operations started with Start.
type Callback interface {
	// OnComplete is called once, with nil or why the operations failed
	// (an error wrapping ErrDown: an operation failed, or the link went
	// down before they completed). It runs on the link's completion
	// goroutine, or on Start's caller before Start returns, and must not
	// block nor call Link methods that wait (TryStart does not).
	OnComplete(err error)
}

// Flusher is work a callback put off to the end of its batch of
// completions (Defer): the front end's replies of several requests, sent
// with one write.
type Flusher interface {
	// Flush does the work put off. It runs on the completion goroutine
	// and must not block, as Callback.OnComplete.
	Flush()
}

// ErrChainTooLong is returned by Start for more operations than one chain
// may hold (MaxChain).
var ErrChainTooLong = errors.New("link: chain longer than the send queue allows")

// Op is one one-sided operation of a batch.
type Op struct {
	// Write is true for RDMA WRITE, false for RDMA READ.
	Write bool
	// Local is the local buffer (destination of a READ, source of a WRITE).
	Local transport.SGE
	// Addr and RKey name the peer's memory.
	Addr uint64
	RKey uint32
}

type batch struct {
	id       uint64
	pending  int // signaled work requests not completed yet
	nops     int // RDMA operations of a chain ended by a SEND: freed with it
	err      error
	done     chan struct{} // signalled at the end of a batch of RDMA
	cb       Callback      // called instead at the end of a batch of Start
	wrs      []transport.WorkRequest
	deadline int64 // UnixNano after which the watchdog expires the link; 0: none
}

type waiter struct {
	tag      uint64
	reply    protocol.Message
	err      error
	done     chan struct{}
	typ      protocol.Type // of the request, for the timeout's error
	timeout  time.Duration
	deadline int64 // UnixNano after which the watchdog expires the link; 0: none
}

// Link is one connection of the rblk control protocol.
type Link struct {
	conn     transport.Conn
	opts     Options
	log      *zap.Logger
	features uint32 // negotiated in the hellos; set before start

	mem        *transport.Memory
	recvRegion transport.Region
	sendRegion transport.Region

	mu           sync.Mutex
	cond         *sync.Cond // signalled when credits, send slots, or down change
	credits      int        // SENDs the peer can take
	toReturn     int        // receive buffers re-posted and not yet announced
	freeSend     []int      // free send slots
	nextTag      uint64
	waiters      map[uint64]*waiter
	batches      map[uint64]*batch
	nextBatch    uint64
	down         error
	downCh       chan struct{}
	creditSignal chan struct{} // wakes creditLoop: credits owed
	pongSignal   chan struct{} // wakes pongLoop: KeepAlive requests to answer
	pongs        []uint64      // tags of KeepAlive requests to answer (at most maxPongsOwed)
	sqRoom       int           // send queue entries free for RDMA operations
	sqWaiters    int           // RDMA posts waiting for sqRoom
	// orphans counts the operations posted by PostOps since the last
	// chain of Start that ends in a SEND: that chain's completion frees
	// their room in the send queue too.
	orphans   int
	orphanWRs []transport.WorkRequest  // PostOps's work requests (mu)
	oneWR     [1]transport.WorkRequest // post's work request (mu)
	// Plugging (mu; see Plug): while plugged, the work requests of Start,
	// PostOps and post wait in plugWRs, in the order they were posted, and
	// go to the connection together when it is unplugged.
	plugged bool
	plugWRs []transport.WorkRequest

	lastRecv atomic.Int64 // when the last message arrived (UnixNano)
	pinging  atomic.Bool  // a KeepAlive request is in flight

	slotBatch   []uint64 // per send slot: the batch a chained SEND ends, or 0
	freeBatches []*batch // (mu) for reuse, so that no IO allocates
	freeWaiters []*waiter

	// Used by the completion goroutine only.
	reposts []transport.RecvRequest // receive buffers to post again
	ended   []*batch                // batches of Start to call back
	flushes []Flusher               // spare for deferred's contents

	// Defer's state: whether the completion goroutine is calling back a
	// batch, and the flushers put off to its end (each once).
	deferMu     sync.Mutex
	callingBack bool
	deferred    []Flusher

	closeOnce sync.Once
	stop      context.CancelFunc
	wg        sync.WaitGroup
}

// pop takes an item off a free list (l.mu held), or makes one.
func pop[T any](free *[]*T, mk func() *T) *T {
	if n := len(*free); n > 0 {
		x := (*free)[n-1]
		*free = (*free)[:n-1]
		return x
	}
	return mk()
}

func newBatch() *batch   { return &batch{done: make(chan struct{}, 1)} }
func newWaiter() *waiter { return &waiter{done: make(chan struct{}, 1)} }

// getBatch takes a batch off the free list; putBatch gives it back.
func (l *Link) getBatch() *batch {
	l.mu.Lock()
	defer l.mu.Unlock()
	return pop(&l.freeBatches, newBatch)
}

func (l *Link) putBatch(b *batch) {
	b.cb, b.err = nil, nil
	l.mu.Lock()
	l.freeBatches = append(l.freeBatches, b)
	l.mu.Unlock()
}

func (l *Link) getWaiter() *waiter {
	l.mu.Lock()
	defer l.mu.Unlock()
	return pop(&l.freeWaiters, newWaiter)
}

func (l *Link) putWaiter(w *waiter) {
	w.reply, w.err = nil, nil
	l.mu.Lock()
	l.freeWaiters = append(l.freeWaiters, w)
	l.mu.Unlock()
}

const bufSize = protocol.MaxMessageSize

// New starts a link over conn, whose peer announced peerCredits receive
// buffers in its hello. It posts opts.RecvBuffers receives before returning;
// the caller must announce that number to the peer (see HelloFor).
func New(conn transport.Conn, peerCredits int, opts Options) (*Link, error) {
	l, err := setup(conn, peerCredits, opts)
	if err != nil {
		return nil, err
	}
	l.start()
	return l, nil
}

// setup makes a link over conn without starting it: it registers the
// message buffers and posts the receives, which a conn of
// ConnRequest.Prepare takes before it is accepted. start starts it; Close
// undoes it.
func setup(conn transport.Conn, peerCredits int, opts Options) (*Link, error) {
	opts.setDefaults()
	if opts.Handler == nil {
		return nil, errors.New("link: Options.Handler is required")
	}
	l := &Link{conn: conn, opts: opts, log: opts.Logger, credits: peerCredits,
		waiters: make(map[uint64]*waiter), batches: make(map[uint64]*batch),
		creditSignal: make(chan struct{}, 1), pongSignal: make(chan struct{}, 1), downCh: make(chan struct{})}
	l.cond = sync.NewCond(&l.mu)
	depth := conn.Limits().SendQueueDepth
	if depth < 4 {
		return nil, fmt.Errorf("link: send queue of %d entries: need at least 4", depth)
	}
	l.opts.SendBuffers = min(l.opts.SendBuffers, depth/2)
	opts.SendBuffers = l.opts.SendBuffers
	l.sqRoom = depth - opts.SendBuffers
	l.lastRecv.Store(time.Now().UnixNano())
	l.slotBatch = make([]uint64, opts.SendBuffers)
	// (What the link posts and has not seen complete never exceeds the
	// send queue: held back by a plug, it fits too.)
	l.plugWRs = make([]transport.WorkRequest, 0, depth)
	n := opts.RecvBuffers + opts.SendBuffers
	mem, err := transport.AllocMemory(n*bufSize, false)
	if err != nil {
		return nil, fmt.Errorf("link: message buffers: %w", err)
	}
	l.mem = mem
	b := mem.Bytes()
	if l.recvRegion, err = conn.Register(b[:opts.RecvBuffers*bufSize], transport.AccessLocalWrite); err != nil {
		mem.Free()
		return nil, fmt.Errorf("link: register receive buffers: %w", err)
	}
	if l.sendRegion, err = conn.Register(b[opts.RecvBuffers*bufSize:], transport.AccessLocalWrite); err != nil {
		l.recvRegion.Deregister()
		mem.Free()
		return nil, fmt.Errorf("link: register send buffers: %w", err)
	}
	for i := opts.SendBuffers - 1; i >= 0; i-- {
		l.freeSend = append(l.freeSend, i)
	}
	rrs := make([]transport.RecvRequest, opts.RecvBuffers)
	for i := range rrs {
		rrs[i] = transport.RecvRequest{ID: kindRecv | uint64(i), Local: transport.SGE{Region: l.recvRegion, Offset: i * bufSize, Length: bufSize}}
	}
	if err := conn.PostRecv(rrs...); err != nil {
		l.recvRegion.Deregister()
		l.sendRegion.Deregister()
		mem.Free()
		return nil, fmt.Errorf("link: post receives: %w", err)
	}
	l.stop = func() {}
	return l, nil
}

// start starts the goroutines of a link from setup.
func (l *Link) start() {
	ctx, cancel := context.WithCancel(context.Background())
	l.stop = cancel
	l.wg.Add(2)
	if ch, ok := l.conn.(transport.CompletionHandler); ok {
		// Completions arrive on the provider's goroutine: no switch to a
		// poller. The last call (with ErrClosed) ends this side as
		// pollLoop's return does.
		ch.HandleCompletions(l.handleCompletions)
	} else {
		go l.pollLoop(ctx)
	}
	go l.creditLoop(ctx)
	l.wg.Add(2)
	go l.pongLoop(ctx)
	go l.watchLoop(ctx)
}

// Conn is the underlying transport connection.
func (l *Link) Conn() transport.Conn { return l.conn }

// Err is nil while the link is up, and why it went down after.
func (l *Link) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.down
}

// Done is closed when the link goes down.
func (l *Link) Done() <-chan struct{} { return l.downCh }

// Close breaks the link: waiting calls return ErrDown, the connection is
// closed and its completions drained. Safe to call twice; it waits for the
// link's goroutines.
func (l *Link) Close() error {
	l.closeOnce.Do(func() {
		l.fail(ErrDown)
		l.conn.Close()
		l.stop()
		l.wg.Wait()
		l.recvRegion.Deregister()
		l.sendRegion.Deregister()
		l.mem.Free()
	})
	return nil
}

// fail marks the link down with err and wakes every waiter.
func (l *Link) fail(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failLocked(err)
}

// failLocked is fail with l.mu held.
func (l *Link) failLocked(err error) {
	if l.down != nil {
		return
	}
	// Work requests held back by a plug never reach the connection: their
	// batches fail with the others once the connection is drained
	// (failBatches).
	l.plugged = false
	clear(l.plugWRs)
	l.plugWRs = l.plugWRs[:0]
	if !errors.Is(err, ErrDown) {
		err = fmt.Errorf("%w: %w", ErrDown, err)
	}
	l.down = err
	close(l.downCh)
	for tag, w := range l.waiters {
		w.err = err
		delete(l.waiters, tag)
		w.done <- struct{}{}
	}
	l.cond.Broadcast()
}

// acquire takes a send slot and, unless credit is true, a peer credit while
// keeping one credit in reserve for Credit messages.
func (l *Link) acquire(ctx context.Context, creditMsg bool) (int, error) {
	reserve := 1
	if creditMsg {
		reserve = 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.down == nil && len(l.freeSend) > 0 && l.credits > reserve {
		// Fast path, without arming a wake-up on ctx.
		slot := l.freeSend[len(l.freeSend)-1]
		l.freeSend = l.freeSend[:len(l.freeSend)-1]
		l.credits--
		return slot, nil
	}
	if l.down == nil && ctx.Err() != nil {
		return 0, ctx.Err() // (TryStart's way: no wake-up armed)
	}
	// What frees a slot or a credit may be held back by a plug.
	l.unplugLocked()
	stopWake := context.AfterFunc(ctx, func() {
		l.mu.Lock()
		l.cond.Broadcast()
		l.mu.Unlock()
	})
	defer stopWake()
	for {
		if l.down != nil {
			return 0, l.down
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		if len(l.freeSend) > 0 && l.credits > reserve {
			slot := l.freeSend[len(l.freeSend)-1]
			l.freeSend = l.freeSend[:len(l.freeSend)-1]
			l.credits--
			return slot, nil
		}
		l.cond.Wait()
	}
}

// post encodes m into a send slot and posts it. The caller holds a slot and a credit.
func (l *Link) post(slot int, tag uint64, m protocol.Message) error {
	l.mu.Lock()
	if l.down != nil {
		// Close may be freeing the send buffers (it does once the link
		// is down): do not touch them. Encoding under l.mu after this
		// check is safe, since Close frees them only after fail took
		// l.mu.
		err := l.down
		l.freeSend = append(l.freeSend, slot)
		l.cond.Broadcast()
		l.mu.Unlock()
		return err
	}
	buf := l.sendRegion.Bytes()[slot*bufSize : (slot+1)*bufSize]
	credits := min(l.toReturn, 0xffff)
	l.toReturn -= credits
	out, err := protocol.Append(buf[:0], uint16(credits), tag, m)
	if err != nil {
		l.toReturn += credits
		l.freeSend = append(l.freeSend, slot)
		l.credits++
		l.cond.Broadcast()
		l.mu.Unlock()
		return fmt.Errorf("encode %v: %w", m.Type(), err)
	}
	// Post under the lock so that credits announced and send order agree.
	l.oneWR[0] = transport.WorkRequest{ID: kindSend | uint64(slot), Op: transport.OpSend,
		Local: transport.SGE{Region: l.sendRegion, Offset: slot * bufSize, Length: len(out)}}
	err = l.postLocked(l.oneWR[:])
	if err != nil && errors.Is(err, transport.ErrQueueFull) {
		// Cannot happen while the link's accounting is right (a SEND
		// holds a send slot, and the slots are room kept for them): a
		// provider bug, reported to this caller only.
		l.toReturn += credits
		l.freeSend = append(l.freeSend, slot)
		l.credits++
		l.cond.Broadcast()
		l.mu.Unlock()
		return fmt.Errorf("post %v: %w", m.Type(), err)
	}
	l.mu.Unlock()
	if err != nil {
		l.fail(fmt.Errorf("post send: %w", err))
		return l.Err()
	}
	return nil
}

// Send sends a one-way message (or a reply, with the request's tag).
// Messages sent by one goroutine arrive in the order sent.
func (l *Link) Send(ctx context.Context, tag uint64, m protocol.Message) error {
	slot, err := l.acquire(ctx, false)
	if err != nil {
		return err
	}
	if testHookAcquired != nil {
		testHookAcquired(l)
	}
	return l.post(slot, tag, m)
}

// testHookAcquired, set by tests only, runs between taking a send slot and
// posting into it.
var testHookAcquired func(*Link)

// WaitSent waits until every message sent so far has completed (the peer's
// receive buffer holds it), the link is down, or ctx ends.
func (l *Link) WaitSent(ctx context.Context) error {
	stopWake := context.AfterFunc(ctx, func() {
		l.mu.Lock()
		l.cond.Broadcast()
		l.mu.Unlock()
	})
	defer stopWake()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.unplugLocked()
	for len(l.freeSend) < l.opts.SendBuffers {
		if l.down != nil {
			return l.down
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		l.cond.Wait()
	}
	return nil
}

// NewTag returns a tag for a request this side originates.
func (l *Link) NewTag() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.nextTag++
	return l.nextTag
}

// Request sends m and waits for the reply, which is unmarshaled into reply.
// An ErrorMsg reply is returned as a *protocol.RemoteError. If ctx ends
// first the request stays sent, and its reply is dropped when it comes. If
// Options.RequestTimeout passes first, the link goes down with ErrTimeout.
func (l *Link) Request(ctx context.Context, m protocol.Message, reply protocol.Message) error {
	return l.RequestWithin(ctx, l.opts.RequestTimeout, m, reply)
}

// RequestWithin is Request with its own timeout instead of
// Options.RequestTimeout (zero: none).
func (l *Link) RequestWithin(ctx context.Context, timeout time.Duration, m protocol.Message, reply protocol.Message) error {
	w := l.getWaiter()
	w.reply, w.err = reply, nil
	l.mu.Lock()
	if l.down != nil {
		err := l.down
		l.mu.Unlock()
		l.putWaiter(w)
		return err
	}
	l.nextTag++
	w.tag = l.nextTag
	w.typ, w.timeout, w.deadline = m.Type(), timeout, 0
	if timeout > 0 {
		w.deadline = time.Now().Add(timeout).UnixNano()
	}
	l.waiters[w.tag] = w
	l.mu.Unlock()

	if err := l.Send(ctx, w.tag, m); err != nil {
		l.mu.Lock()
		_, mine := l.waiters[w.tag]
		delete(l.waiters, w.tag)
		l.mu.Unlock()
		if !mine { // fail() or a reply already signalled it
			<-w.done
		}
		l.putWaiter(w)
		return err
	}
	// The request may be held back by a plug: it goes now.
	l.Unplug()
	// The watchdog (see watchLoop) takes the link down at w.deadline,
	// which signals w.
	select {
	case <-w.done:
		err := w.err
		l.putWaiter(w)
		return err
	case <-ctx.Done():
		l.mu.Lock()
		_, mine := l.waiters[w.tag]
		delete(l.waiters, w.tag)
		l.mu.Unlock()
		if !mine {
			<-w.done // signalled concurrently: drain before reuse
			l.putWaiter(w)
		}
		return ctx.Err()
	}
}

// expire takes the link down because the peer did not answer in time, and
// closes the connection so that every operation in flight completes; then
// it stops polling, so that not even a stuck completion path keeps the
// waiters (once Close returned, the provider no longer touches buffers).
func (l *Link) expire(err error) {
	l.log.Warn("peer timed out, closing the link", append([]zap.Field{zap.Error(err)}, l.stateFields()...)...)
	l.fail(err)
	go func() {
		l.conn.Close()
		l.stop()
	}()
}

// stateFields describes the link's flow control at this moment, for the
// log line of a link that timed out: whether it could still send (the
// peer's credits, free send slots, the send queue's room), what it owed
// the peer (credits not yet returned, pings to answer), what it waited for
// (requests, RDMA batches), and when it last heard from the peer. A stall
// of the transport (send completions that stop) shows as no free slots; a
// flow-control deadlock as no credits on both sides.
func (l *Link) stateFields() []zap.Field {
	l.mu.Lock()
	defer l.mu.Unlock()
	return []zap.Field{zap.Dict("link",
		zap.Int("peer_credits", l.credits),
		zap.Int("credits_to_return", l.toReturn),
		zap.String("send_slots_free", fmt.Sprintf("%d/%d", len(l.freeSend), l.opts.SendBuffers)),
		zap.Int("sq_room", l.sqRoom),
		zap.Int("sq_waiters", l.sqWaiters),
		zap.Int("requests_waiting", len(l.waiters)),
		zap.Int("rdma_batches", len(l.batches)),
		zap.Int("pongs_owed", len(l.pongs)),
		zap.Bool("pinging", l.pinging.Load()),
		zap.Bool("plugged", l.plugged),
		zap.Int("plugged_wrs", len(l.plugWRs)),
		zap.Duration("since_last_recv", time.Since(time.Unix(0, l.lastRecv.Load())).Round(time.Millisecond)),
	)}
}

// reserveSQ takes up to want entries of the send queue's room for RDMA
// operations, at least one (all of them if all), waiting while there is
// not that much.
func (l *Link) reserveSQ(ctx context.Context, want int, all bool) (int, error) {
	need := 1
	if all {
		need = want
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.down == nil && l.sqRoom >= need && l.sqWaiters == 0 {
		k := min(want, l.sqRoom)
		l.sqRoom -= k
		return k, nil
	}
	if l.down == nil && ctx.Err() != nil {
		return 0, ctx.Err()
	}
	// What frees room in the send queue may be held back by a plug.
	l.unplugLocked()
	stopWake := context.AfterFunc(ctx, func() {
		l.mu.Lock()
		l.cond.Broadcast()
		l.mu.Unlock()
	})
	defer stopWake()
	l.sqWaiters++
	defer func() { l.sqWaiters-- }()
	for {
		if l.down != nil {
			return 0, l.down
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		if l.sqRoom >= need {
			k := min(want, l.sqRoom)
			l.sqRoom -= k
			return k, nil
		}
		l.cond.Wait()
	}
}

// RDMA posts ops as chains of work requests and waits until all of them
// completed. The link admits them to the send queue: they wait (with ctx)
// for room, in pieces when the chain is longer than the room, so a full
// queue never fails them. Once posted, operations cannot be cancelled
// (their buffers are in the provider's hands): ctx only bounds the wait
// before posting, and Options.RequestTimeout the wait for completions,
// after which the link goes down with ErrTimeout. An operation's failure
// breaks the link. Only the last work request of each piece is signaled.
func (l *Link) RDMA(ctx context.Context, ops ...Op) error {
	if len(ops) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b := l.getBatch()
	b.pending = 1 // until every piece is posted, so that none ends it early
	b.deadline = l.deadline()
	l.mu.Lock()
	if l.down != nil {
		err := l.down
		l.mu.Unlock()
		l.putBatch(b)
		return err
	}
	l.nextBatch++
	id := l.nextBatch & 0xffffffffffff
	b.id = id
	l.batches[id] = b
	l.mu.Unlock()
	var err error
	for posted := 0; posted < len(ops); {
		var k int
		if k, err = l.reserveSQ(ctx, min(len(ops)-posted, maxPiece), false); err != nil {
			break
		}
		b.wrs = b.wrs[:0]
		for i, op := range ops[posted : posted+k] {
			b.wrs = append(b.wrs, rdmaWR(id, op, i == k-1, k))
		}
		l.mu.Lock()
		b.pending++
		// RDMA waits for its operations: what a plug holds goes first.
		l.unplugLocked()
		err = l.postNow(b.wrs)
		l.mu.Unlock()
		if err != nil {
			l.releaseSQ(k)
			l.mu.Lock()
			b.pending--
			l.mu.Unlock()
			if !errors.Is(err, transport.ErrQueueFull) {
				l.fail(fmt.Errorf("post rdma: %w", err))
				err = l.Err()
			}
			break
		}
		posted += k
	}
	// The rest is not posted: what was posted completes in its own time,
	// then b.done is signalled. The watchdog takes the link down at
	// b.deadline; the poll loop then ends with the connection and fails b.
	l.mu.Lock()
	if err != nil && b.err == nil {
		b.err = err
	}
	if l.batches[id] == b {
		b.pending--
		if b.pending == 0 {
			delete(l.batches, id)
			b.done <- struct{}{}
		}
	}
	l.mu.Unlock()
	<-b.done
	err = b.err
	l.putBatch(b)
	return err
}

// rdmaWR is the work request of op in batch id; last marks the signaled
// end of a piece of k work requests.
func rdmaWR(id uint64, op Op, last bool, k int) transport.WorkRequest {
	wr := transport.WorkRequest{ID: kindRDMA | id<<8, Local: op.Local, RemoteAddr: op.Addr, RKey: op.RKey,
		Op: transport.OpRead, Unsignaled: !last}
	if op.Write {
		wr.Op = transport.OpWrite
	}
	if last {
		wr.ID |= uint64(k)
	}
	return wr
}

func (l *Link) deadline() int64 {
	if l.opts.RequestTimeout > 0 {
		return time.Now().Add(l.opts.RequestTimeout).UnixNano()
	}
	return 0
}

// MaxChain is the most operations Start takes at once.
func (l *Link) MaxChain() int {
	return min(maxPiece, l.conn.Limits().SendQueueDepth-l.opts.SendBuffers)
}

// Start posts ops as one chain of work requests, followed in the same chain
// by msg (a one-way message) unless msg is nil, and returns without
// waiting for them: cb.OnComplete is called once they all completed. With
// msg, that is when the SEND completed, which on a reliable connection
// means the operations before it were executed by the peer, so a write's
// data is in place before its Done is seen. Only the last work request is
// signaled.
//
// It waits (with ctx) for room in the send queue for all of ops, and for
// a send slot and a credit for msg. If it returns an error, nothing was
// posted and cb will not be called. len(ops) may not exceed MaxChain.
// Options.RequestTimeout bounds the wait for the completions, as for RDMA.
func (l *Link) Start(ctx context.Context, cb Callback, msg protocol.Message, ops ...Op) error {
	if len(ops) > l.MaxChain() {
		return fmt.Errorf("%w: %d operations", ErrChainTooLong, len(ops))
	}
	if len(ops) == 0 && msg == nil {
		cb.OnComplete(nil)
		return nil
	}
	slot := -1
	if msg != nil {
		var err error
		if slot, err = l.acquire(ctx, false); err != nil {
			return err
		}
	}
	if len(ops) > 0 {
		if _, err := l.reserveSQ(ctx, len(ops), true); err != nil {
			if slot >= 0 {
				l.unacquire(slot)
			}
			return err
		}
	}
	b := l.getBatch()
	b.cb, b.pending, b.nops, b.deadline = cb, 1, 0, l.deadline()
	l.mu.Lock()
	if l.down != nil {
		err := l.down
		l.sqRoom += len(ops)
		if slot >= 0 {
			l.freeSend = append(l.freeSend, slot)
		}
		l.cond.Broadcast()
		l.mu.Unlock()
		l.putBatch(b)
		return err
	}
	l.nextBatch++
	id := l.nextBatch & 0xffffffffffff
	b.id = id
	b.wrs = b.wrs[:0]
	for i, op := range ops {
		b.wrs = append(b.wrs, rdmaWR(id, op, msg == nil && i == len(ops)-1, len(ops)))
	}
	credits := 0
	if msg != nil {
		// Encoded and posted under the lock, as post does, so that the
		// credits announced and the send order agree.
		buf := l.sendRegion.Bytes()[slot*bufSize : (slot+1)*bufSize]
		credits = min(l.toReturn, 0xffff)
		out, err := protocol.Append(buf[:0], uint16(credits), 0, msg)
		if err != nil {
			l.sqRoom += len(ops)
			l.freeSend = append(l.freeSend, slot)
			l.credits++
			l.cond.Broadcast()
			l.mu.Unlock()
			l.putBatch(b)
			return fmt.Errorf("encode %v: %w", msg.Type(), err)
		}
		l.toReturn -= credits
		// The SEND's completion means every work request before it is
		// done, the unsignaled ones of PostOps too.
		b.nops = len(ops) + l.orphans
		l.orphans = 0
		l.slotBatch[slot] = id
		b.wrs = append(b.wrs, transport.WorkRequest{ID: kindSend | uint64(slot), Op: transport.OpSend,
			Local: transport.SGE{Region: l.sendRegion, Offset: slot * bufSize, Length: len(out)}})
	}
	l.batches[id] = b
	err := l.postLocked(b.wrs)
	if err != nil {
		delete(l.batches, id)
		l.sqRoom += len(ops)
		if slot >= 0 {
			l.orphans += b.nops - len(ops)
			l.slotBatch[slot] = 0
			l.toReturn += credits
			l.freeSend = append(l.freeSend, slot)
			l.credits++
		}
		l.cond.Broadcast()
	}
	l.mu.Unlock()
	if err != nil {
		l.putBatch(b)
		if !errors.Is(err, transport.ErrQueueFull) {
			l.fail(fmt.Errorf("post rdma: %w", err))
			return l.Err()
		}
		return fmt.Errorf("post rdma: %w", err)
	}
	return nil
}

// Plug holds back the work requests posted from now on (by Start,
// TryStart, PostOps and one-way messages, whoever calls them) until
// Unplug, which hands them all to the connection in one call: on RDMA one
// doorbell, and one pass of the device, for the requests of many IOs, as
// the block layer's plugging and NVMe's deferred doorbell do. The order of
// the requests is kept. Calls that wait (RDMA, Request, WaitSent, and a
// Start or PostOps that must wait for a send slot, a credit or room in the
// send queue) unplug the link first, since what they wait for may be held
// back.
//
// The caller must call Unplug before it blocks on anything else (a
// socket, a buffer): requests held back make no progress until then, nor
// does whatever waits for them. Plug and Unplug do not block (Unplug
// posts) and do not allocate.
func (l *Link) Plug() {
	l.mu.Lock()
	if l.down == nil {
		l.plugged = true
	}
	l.mu.Unlock()
}

// Unplug ends Plug: what it held back goes to the connection now. If the
// connection refuses it, the link goes down, and the chains held back fail
// as those in flight do (their callbacks get the error).
func (l *Link) Unplug() {
	l.mu.Lock()
	l.unplugLocked()
	l.mu.Unlock()
}

// unplugLocked is Unplug with l.mu held.
func (l *Link) unplugLocked() {
	l.plugged = false
	if len(l.plugWRs) == 0 {
		return
	}
	err := l.postNow(l.plugWRs)
	clear(l.plugWRs)
	l.plugWRs = l.plugWRs[:0]
	if err != nil {
		l.failLocked(fmt.Errorf("post send: %w", err))
	}
}

// postLocked hands wrs to the connection, or holds them back while the
// link is plugged (l.mu held). An error means none of wrs was posted.
func (l *Link) postLocked(wrs []transport.WorkRequest) error {
	if !l.plugged {
		return l.postNow(wrs)
	}
	if len(l.plugWRs)+len(wrs) > cap(l.plugWRs) {
		// (Cannot happen while the accounting holds: see setup.)
		l.unplugLocked()
		if l.down != nil {
			return l.down
		}
		return l.postNow(wrs)
	}
	l.plugWRs = append(l.plugWRs, wrs...)
	return nil
}

// postNow hands wrs to the connection and counts the call.
func (l *Link) postNow(wrs []transport.WorkRequest) error {
	if l.opts.Posts != nil {
		l.opts.Posts.Inc()
	}
	return l.conn.PostSend(wrs...)
}

// ErrWouldWait is returned by TryStart where Start would wait.
var ErrWouldWait = errors.New("link: no send slot, credit or send queue room free now")

// endedCtx is an ended context: Start with it waits for nothing.
var endedCtx = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// TryStart is Start that does not wait: where Start would wait for a send
// slot, a credit or room in the send queue it posts nothing and returns
// ErrWouldWait. Unlike Start, it may be called from a Callback.
func (l *Link) TryStart(cb Callback, msg protocol.Message, ops ...Op) error {
	err := l.Start(endedCtx, cb, msg, ops...)
	if errors.Is(err, context.Canceled) {
		return ErrWouldWait
	}
	return err
}

// PostOps posts ops as unsignaled work requests and returns without
// waiting for them: nothing reports their success. They are known done
// once a chain that Start posts after them with a message completes, and
// that completion gives back their room in the send queue: the caller
// must follow them with one (as a write's RDMA WRITEs are followed by the
// Done that reports them), whose callback gets the error of any of them
// that failed (a failure breaks the link). It waits (with ctx) for room in
// the send queue for all of ops; if it returns an error, nothing was
// posted. len(ops) may not exceed MaxChain.
func (l *Link) PostOps(ctx context.Context, ops ...Op) error {
	if len(ops) > l.MaxChain() {
		return fmt.Errorf("%w: %d operations", ErrChainTooLong, len(ops))
	}
	if len(ops) == 0 {
		return nil
	}
	if _, err := l.reserveSQ(ctx, len(ops), true); err != nil {
		return err
	}
	l.mu.Lock()
	if l.down != nil {
		err := l.down
		l.sqRoom += len(ops)
		l.cond.Broadcast()
		l.mu.Unlock()
		return err
	}
	wrs := l.orphanWRs[:0]
	for _, op := range ops {
		// Batch 0 is no batch: a failure is reported by the link going
		// down, and to the chain that follows.
		wrs = append(wrs, rdmaWR(0, op, false, 0))
	}
	l.orphanWRs = wrs
	err := l.postLocked(wrs)
	clear(wrs)
	if err == nil {
		l.orphans += len(ops)
	} else {
		l.sqRoom += len(ops)
		l.cond.Broadcast()
	}
	l.mu.Unlock()
	if err != nil {
		if !errors.Is(err, transport.ErrQueueFull) {
			l.fail(fmt.Errorf("post rdma: %w", err))
			return l.Err()
		}
		return fmt.Errorf("post rdma: %w", err)
	}
	return nil
}

// unacquire gives back a send slot and its credit, unused.
func (l *Link) unacquire(slot int) {
	l.mu.Lock()
	l.freeSend = append(l.freeSend, slot)
	l.credits++
	l.cond.Broadcast()
	l.mu.Unlock()
}

func (l *Link) releaseSQ(n int) {
	l.mu.Lock()
	l.sqRoom += n
	l.cond.Broadcast()
	l.mu.Unlock()
}

func (l *Link) pollLoop(ctx context.Context) {
	defer l.wg.Done()
	comps := make([]transport.Completion, 64)
	for {
		n, err := l.conn.Poll(ctx, comps)
		l.completions(comps[:n])
		if err != nil {
			if errors.Is(err, transport.ErrClosed) || errors.Is(err, context.Canceled) {
				l.fail(ErrDown)
			} else {
				l.fail(fmt.Errorf("poll: %w", err))
			}
			l.failBatches()
			return
		}
	}
}

// handleCompletions is the transport.CompletionHandler's function: it does
// what pollLoop does, on the provider's goroutine.
func (l *Link) handleCompletions(cs []transport.Completion, err error) {
	l.completions(cs)
	if err != nil {
		if errors.Is(err, transport.ErrClosed) {
			l.fail(ErrDown)
		} else {
			l.fail(fmt.Errorf("poll: %w", err))
		}
		l.failBatches()
		l.wg.Done()
	}
}

// completions handles a batch of completions, then posts the receive
// buffers they freed again in one call and calls back the batches of Start
// that ended.
func (l *Link) completions(cs []transport.Completion) {
	for i := range cs {
		l.complete(&cs[i])
	}
	if len(l.reposts) > 0 {
		err := l.conn.PostRecv(l.reposts...)
		n := len(l.reposts)
		clear(l.reposts)
		l.reposts = l.reposts[:0]
		switch {
		case errors.Is(err, transport.ErrClosed):
			// The connection is closing (the peer disconnected). What it
			// received before is still to come from Poll, which reports
			// the end after it: a reply there (an error that says why the
			// peer closed) reaches its request, and the link goes down
			// then. Failing here would answer that request "link down".
		case err != nil:
			l.fail(fmt.Errorf("repost receive: %w", err))
		default:
			l.mu.Lock()
			l.toReturn += n
			signal := l.toReturn >= l.opts.RecvBuffers/2
			l.mu.Unlock()
			if signal {
				select {
				case l.creditSignal <- struct{}{}:
				default:
				}
			}
		}
	}
	l.callBack()
}

// callBack calls the callbacks of the batches that ended, outside l.mu,
// and then flushes what they put off (Defer).
func (l *Link) callBack() {
	if len(l.ended) == 0 {
		return
	}
	l.deferMu.Lock()
	l.callingBack = true
	l.deferMu.Unlock()
	for i, b := range l.ended {
		cb, err := b.cb, b.err
		l.ended[i] = nil
		l.putBatch(b)
		cb.OnComplete(err)
	}
	l.ended = l.ended[:0]
	l.deferMu.Lock()
	l.callingBack = false
	fs := l.deferred
	l.deferred = l.flushes[:0]
	l.deferMu.Unlock()
	for i, f := range fs {
		fs[i] = nil
		f.Flush()
	}
	l.flushes = fs[:0]
}

// Defer puts f off to the end of the batch of completions whose callbacks
// the completion goroutine is running: once they all ran, f.Flush is
// called, once however often f was deferred. It reports false, and
// registers nothing, when no batch is being called back (a callback run by
// Start's caller, or no callback at all): the caller then does the work
// itself. A callback uses it to send the replies of many requests with one
// write (see blockdev.BatchCompletion). It does not block nor allocate,
// once the batches have been as large before.
func (l *Link) Defer(f Flusher) bool {
	l.deferMu.Lock()
	defer l.deferMu.Unlock()
	if !l.callingBack {
		return false
	}
	for _, g := range l.deferred {
		if g == f {
			return true
		}
	}
	l.deferred = append(l.deferred, f)
	return true
}

// endLocked ends batch b (l.mu held): its waiter is signalled, or its
// callback queued for the completion goroutine.
func (l *Link) endLocked(b *batch) {
	delete(l.batches, b.id)
	if b.cb != nil {
		l.ended = append(l.ended, b)
		return
	}
	b.done <- struct{}{}
}

// failBatches completes every RDMA batch still waiting once no more
// completions can come.
func (l *Link) failBatches() {
	l.mu.Lock()
	for _, b := range l.batches {
		if b.err == nil {
			b.err = l.down
		}
		l.endLocked(b)
	}
	clear(l.slotBatch)
	l.mu.Unlock()
	l.callBack()
}

func (l *Link) complete(c *transport.Completion) {
	switch c.ID & kindMask {
	case kindRecv:
		slot := int(c.ID &^ kindMask)
		if c.Status != transport.StatusSuccess {
			if c.Status != transport.StatusFlushed {
				l.fail(fmt.Errorf("receive: %w", c.Err()))
			}
			return
		}
		l.receive(slot, c.ByteLen)
	case kindSend:
		slot := int(c.ID &^ kindMask)
		l.mu.Lock()
		l.freeSend = append(l.freeSend, slot)
		if id := l.slotBatch[slot]; id != 0 {
			// The SEND that ends a chain of Start: the chain's
			// operations before it are done too.
			l.slotBatch[slot] = 0
			if b := l.batches[id]; b != nil {
				l.sqRoom += b.nops
				if c.Status != transport.StatusSuccess && b.err == nil {
					b.err = fmt.Errorf("%w: %w", ErrDown, c.Err())
				}
				l.endLocked(b)
			}
		}
		l.cond.Broadcast()
		l.mu.Unlock()
		if c.Status != transport.StatusSuccess && c.Status != transport.StatusFlushed {
			l.fail(fmt.Errorf("send: %w", c.Err()))
		}
	case kindRDMA:
		id := (c.ID &^ kindMask) >> 8
		covers := int(c.ID & maxPiece)
		l.mu.Lock()
		l.sqRoom += covers
		if l.sqWaiters > 0 && covers > 0 {
			l.cond.Broadcast()
		}
		b := l.batches[id]
		if b == nil {
			// PostOps's (batch 0), or a batch that ended already.
			l.mu.Unlock()
			if c.Status != transport.StatusSuccess && c.Status != transport.StatusFlushed {
				l.fail(c.Err())
			}
			return
		}
		if c.Status != transport.StatusSuccess && b.err == nil {
			b.err = fmt.Errorf("%w: %w", ErrDown, c.Err())
		}
		// Unsignaled work requests complete only when they fail (or on
		// a provider that signals every one): the batch waits for its
		// signaled ones.
		if covers > 0 {
			b.pending--
			if b.pending == 0 {
				l.endLocked(b)
			}
		}
		l.mu.Unlock()
		if c.Status != transport.StatusSuccess && c.Status != transport.StatusFlushed {
			l.fail(c.Err())
		}
	}
}

func isReply(t protocol.Type) bool {
	switch t {
	case protocol.TypeError, protocol.TypeExportList, protocol.TypeVolumeInfo, protocol.TypeGrant,
		protocol.TypeRevokeAck, protocol.TypeOK, protocol.TypeAuthChallenge, protocol.TypeAuthAccept:
		return true
	}
	return false
}

func (l *Link) receive(slot, n int) {
	buf := l.recvRegion.Bytes()[slot*bufSize : slot*bufSize+n]
	h, err := protocol.ParseHeader(buf)
	if err == nil && int(h.Length) != n-protocol.HeaderSize {
		err = fmt.Errorf("message length %d, received %d: %w", h.Length, n-protocol.HeaderSize, protocol.ErrTruncated)
	}
	if err != nil {
		l.log.Warn("malformed message, closing link", zap.Error(err))
		l.fail(fmt.Errorf("receive: %w", err))
		go l.conn.Close()
		return
	}
	payload := buf[protocol.HeaderSize:]
	if l.opts.KeepAlive > 0 {
		l.lastRecv.Store(time.Now().UnixNano())
	}
	l.mu.Lock()
	l.credits += int(h.Credits)
	if h.Credits > 0 {
		l.cond.Broadcast()
	}
	var w *waiter
	if isReply(h.Type) {
		w = l.waiters[h.Tag]
		delete(l.waiters, h.Tag)
	}
	l.mu.Unlock()

	switch {
	case w != nil:
		w.err = l.decodeReply(h, payload, w.reply)
		w.done <- struct{}{}
	case h.Type == protocol.TypeCredit:
	case h.Type == protocol.TypeKeepAlive:
		if len(payload) != 0 || h.Tag == 0 {
			l.log.Warn("malformed KeepAlive, closing link")
			l.fail(fmt.Errorf("receive: KeepAlive with tag %d and %d bytes: %w", h.Tag, len(payload), protocol.ErrProtocol))
			go l.conn.Close()
			return
		}
		l.mu.Lock()
		owed := len(l.pongs)
		if owed < maxPongsOwed {
			l.pongs = append(l.pongs, h.Tag)
		}
		l.mu.Unlock()
		if owed >= maxPongsOwed {
			// A peer waits for each answer before it asks again: this
			// one asks without reading them.
			l.log.Warn("KeepAlive requests beyond those owed an answer, closing link", zap.Int("owed", owed))
			l.fail(fmt.Errorf("receive: more than %d KeepAlive requests unanswered: %w", maxPongsOwed, protocol.ErrProtocol))
			go l.conn.Close()
			return
		}
		select {
		case l.pongSignal <- struct{}{}:
		default:
		}
	case isReply(h.Type) && h.Tag != 0:
		// A reply nobody waits for any more (its request was cancelled).
		// Tag 0 is never a request's: an Error with tag 0 is a notice
		// (such as a shutdown) and goes to the handler.
	default:
		l.opts.Handler(h, payload)
	}

	// Give the buffer back (with the others of this batch of
	// completions, see completions) and count it as a credit to return.
	l.repost(slot)
}

func (l *Link) repost(slot int) {
	l.reposts = append(l.reposts, transport.RecvRequest{ID: kindRecv | uint64(slot),
		Local: transport.SGE{Region: l.recvRegion, Offset: slot * bufSize, Length: bufSize}})
}

func (l *Link) decodeReply(h protocol.Header, payload []byte, reply protocol.Message) error {
	if h.Type == protocol.TypeError {
		var em protocol.ErrorMsg
		if err := em.Unmarshal(payload); err != nil {
			return fmt.Errorf("decode error reply: %w", err)
		}
		return &protocol.RemoteError{Code: em.Code, Text: em.Text}
	}
	if reply == nil || reply.Type() != h.Type {
		return fmt.Errorf("%w: got %v", ErrUnexpectedReply, h.Type)
	}
	if err := reply.Unmarshal(payload); err != nil {
		return fmt.Errorf("decode %v: %w", h.Type, err)
	}
	return nil
}

// maxPongsOwed bounds the KeepAlive requests a link holds unanswered: a
// peer has one in flight at a time (its next waits for the answer), so
// more is a peer that floods them, and the link goes down.
const maxPongsOwed = 8

// creditLoop returns the peer its credits with a Credit message when many
// receive buffers were re-posted and no other message carried them back.
// It sends with the credit kept for it, so it never waits for one: it is
// apart from pongLoop, whose answers do wait for credits, so that an
// answer waiting never holds back the credits that would free it.
func (l *Link) creditLoop(ctx context.Context) {
	defer l.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.creditSignal:
		}
		l.mu.Lock()
		need := l.toReturn >= l.opts.RecvBuffers/2 && l.down == nil
		l.mu.Unlock()
		if !need {
			continue
		}
		slot, err := l.acquire(ctx, true)
		if err != nil {
			return
		}
		if err := l.post(slot, 0, &protocol.Credit{}); err != nil {
			return
		}
	}
}

// pongLoop sends the OK replies to the peer's KeepAlive requests, which
// the completion goroutine must not wait to send.
func (l *Link) pongLoop(ctx context.Context) {
	defer l.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.pongSignal:
		}
		for {
			l.mu.Lock()
			var pong uint64
			if len(l.pongs) > 0 {
				pong = l.pongs[0]
				l.pongs = l.pongs[1:]
			}
			l.mu.Unlock()
			if pong == 0 {
				break
			}
			if err := l.Send(ctx, pong, &protocol.OK{}); err != nil {
				return
			}
		}
	}
}
