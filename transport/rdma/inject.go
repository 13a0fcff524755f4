//go:build linux

package rdma

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// Failpoints: faults injected at the device interfaces (internal/verbs),
// by a decorator of them, so that the provider's error paths run on a
// real device under a soak, and the same injection code runs in the
// default tests over the fake device. A program has them only when built
// with the tag failpoints (failpoints.go), and then only when
// FailpointsEnv names some.
//
// Every fault is one the device itself can produce, delivered the way the
// device delivers it: a refused post takes the requests before the refused
// one, as ibv_post_send does; a completion turned into an error is a send
// request's (RETRY_EXC_ERR: the peer may or may not have executed it, as
// after lost acknowledgements), and the send requests completing after it
// complete flushed (the device flushes a QP in error), while receives
// that arrived stay as they are; a disconnect is a real rdma_disconnect of
// the connection (both ends get DISCONNECTED from the RDMA CM); a
// REJECTED replaces the ESTABLISHED of an accepted connection (the peer,
// connected, sees it torn down as the acceptor closes it).

// FailpointsEnv names the environment variable that turns failpoints on in
// a program built with the tag failpoints: a comma-separated list of
// NAME=N/M (each chance of NAME fires with probability N/M), optionally
// NAME=N/M#L (at most L times), and seed=S (the PRNG's seed; default the
// clock, logged). For example
//
//	RBLK_RDMA_FAILPOINTS="seed=7,qp_create=1/50,post_send=1/2000,cq_error=1/5000,disconnect_midio=1/5000"
//
// The names (FailpointNames): qp_create and cq_create (rdma_create_qp
// and ibv_create_cq fail with ENOMEM), mw_alloc (ibv_alloc_mw fails with
// ENOMEM), mw_bind (the post of a memory-window bind is refused with
// ENOMEM), post_send and post_recv (ibv_post_send or ibv_post_recv takes
// a random prefix of the chain and refuses the rest with ENOMEM), cq_error
// (a successful send completion polled becomes IBV_WC_RETRY_EXC_ERR, and
// the send completions after it are flushed), connect and accept
// (rdma_connect and rdma_accept fail with ENOMEM), reject_midio (an
// accepting side gets REJECTED instead of ESTABLISHED, its prepared
// receives in flight), disconnect_midio (rdma_disconnect of the
// connection right after a post). Each injection is logged at warn level
// through the provider's logger with its count.
const FailpointsEnv = "RBLK_RDMA_FAILPOINTS"

// failpoint names a point of injection.
type failpoint uint8

const (
	fpQPCreate failpoint = iota
	fpCQCreate
	fpMWAlloc
	fpMWBind
	fpPostSend
	fpPostRecv
	fpCQError
	fpConnect
	fpAccept
	fpRejectMidIO
	fpDisconnectMidIO
	numFailpoints
)

// FailpointNames are the names FailpointsEnv takes.
var FailpointNames = [numFailpoints]string{
	"qp_create", "cq_create", "mw_alloc", "mw_bind", "post_send", "post_recv",
	"cq_error", "connect", "accept", "reject_midio", "disconnect_midio",
}

// fpRule is how often a failpoint fires: n times in m, at most limit
// times (0: no limit).
type fpRule struct {
	n, m  uint64
	limit uint64
}

// failpoints decide, log and count the injections.
type failpoints struct {
	log   *zap.Logger
	spec  string
	seed  uint64
	rules [numFailpoints]fpRule
	mu    sync.Mutex
	rng   *rand.Rand
	count [numFailpoints]atomic.Uint64
}

// parseFailpoints parses the value of FailpointsEnv. Without a seed= it
// takes the clock's.
func parseFailpoints(spec string, log *zap.Logger) (*failpoints, error) {
	fp := &failpoints{log: log, spec: spec, seed: uint64(time.Now().UnixNano())}
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, val, ok := strings.Cut(item, "=")
		if !ok {
			return nil, fmt.Errorf("%s: %q: want NAME=N/M or seed=S", FailpointsEnv, item)
		}
		if name == "seed" {
			s, err := strconv.ParseUint(val, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("%s: seed %q: %w", FailpointsEnv, val, err)
			}
			fp.seed = s
			continue
		}
		i := failpointIndex(name)
		if i < 0 {
			return nil, fmt.Errorf("%s: unknown failpoint %q (known: %s)", FailpointsEnv, name, strings.Join(FailpointNames[:], ", "))
		}
		var r fpRule
		frac, lim, hasLim := strings.Cut(val, "#")
		ns, ms, ok := strings.Cut(frac, "/")
		var err1, err2, err3 error
		r.n, err1 = strconv.ParseUint(ns, 10, 64)
		r.m, err2 = strconv.ParseUint(ms, 10, 64)
		if hasLim {
			r.limit, err3 = strconv.ParseUint(lim, 10, 64)
		}
		if !ok || errors.Join(err1, err2, err3) != nil || r.m == 0 || r.n > r.m || (hasLim && r.limit == 0) {
			return nil, fmt.Errorf("%s: %s=%q: want N/M with 0 <= N <= M and M > 0, optionally #L with L > 0", FailpointsEnv, name, val)
		}
		fp.rules[i] = r
	}
	fp.rng = rand.New(rand.NewPCG(fp.seed, fp.seed^0x5eed))
	return fp, nil
}

func failpointIndex(name string) int {
	for i, n := range FailpointNames {
		if n == name {
			return i
		}
	}
	return -1
}

// fire reports whether point p injects now, and logs and counts it if so.
func (fp *failpoints) fire(p failpoint, fields ...zap.Field) bool {
	r := &fp.rules[p]
	if r.n == 0 {
		return false
	}
	fp.mu.Lock()
	hit := fp.rng.Uint64N(r.m) < r.n
	if hit && r.limit > 0 && fp.count[p].Load() >= r.limit {
		hit = false
	}
	var n uint64
	if hit {
		n = fp.count[p].Add(1)
	}
	fp.mu.Unlock()
	if hit {
		fp.log.Warn("rdma failpoint: injecting a fault", append(fields, zap.String("failpoint", FailpointNames[p]), zap.Uint64("count", n))...)
	}
	return hit
}

// intn is a random number in [0, n), n > 0.
func (fp *failpoints) intn(n int) int {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	return fp.rng.IntN(n)
}

// counts returns how many times each failpoint fired, by name.
func (fp *failpoints) counts() map[string]uint64 {
	out := make(map[string]uint64)
	for i := range fp.count {
		if n := fp.count[i].Load(); n > 0 || fp.rules[i].n > 0 {
			out[FailpointNames[i]] = n
		}
	}
	return out
}

// errInjected is the error of an injected failure: the errno the call
// would give, marked as injected for the logs.
func errInjected(op string, e syscall.Errno) error {
	return fmt.Errorf("%s: %w (injected by %s)", op, e, FailpointsEnv)
}

// wrap returns stack with fp's faults injected.
func (fp *failpoints) wrap(stack verbs.Stack) verbs.Stack { return &fpStack{inner: stack, fp: fp} }

type fpStack struct {
	inner verbs.Stack
	fp    *failpoints
}

func (s *fpStack) NewEventChannel() (verbs.EventChannel, error) {
	ch, err := s.inner.NewEventChannel()
	if err != nil {
		return nil, err
	}
	return &fpChannel{EventChannel: ch, fp: s.fp}, nil
}

func (s *fpStack) NewID(ch verbs.EventChannel) (verbs.CMID, error) {
	id, err := s.inner.NewID(ch.(*fpChannel).EventChannel)
	if err != nil {
		return nil, err
	}
	return &fpID{CMID: id, fp: s.fp}, nil
}

// fpChannel is an event channel; accepting: an accepted connection's
// (a request's id was migrated to it).
type fpChannel struct {
	verbs.EventChannel
	fp        *failpoints
	accepting atomic.Bool
}

func (ch *fpChannel) GetEvent() (verbs.Event, error) {
	ev, err := ch.EventChannel.GetEvent()
	if err != nil {
		return ev, err
	}
	if ev.ID != nil {
		ev.ID = &fpID{CMID: ev.ID, fp: ch.fp}
	}
	if ev.ListenID != nil {
		ev.ListenID = &fpID{CMID: ev.ListenID, fp: ch.fp}
	}
	if ev.Type == verbs.EventEstablished && ch.accepting.Load() && ch.fp.fire(fpRejectMidIO) {
		// The peer's CM refused our REP (a REJ, consumer defined): the
		// acceptor closes the connection, which the peer then sees end.
		ev = verbs.Event{Type: verbs.EventRejected, Status: rejectConsumerDefined}
	}
	return ev, nil
}

// fpID is an RDMA CM id.
type fpID struct {
	verbs.CMID
	fp *failpoints
}

func (id *fpID) Migrate(ch verbs.EventChannel) error {
	fc := ch.(*fpChannel)
	if err := id.CMID.Migrate(fc.EventChannel); err != nil {
		return err
	}
	fc.accepting.Store(true)
	return nil
}

func (id *fpID) Context() verbs.Context {
	ctx := id.CMID.Context()
	if ctx == nil {
		return nil
	}
	return &fpContext{Context: ctx, fp: id.fp}
}

func (id *fpID) CreateQP(pd verbs.PD, cq verbs.CQ, want verbs.QPCaps, chunk int) (verbs.QP, error) {
	if id.fp.fire(fpQPCreate) {
		return nil, errInjected("rdma_create_qp", syscall.ENOMEM)
	}
	qp, err := id.CMID.CreateQP(pd.(*fpPD).PD, cq.(*fpCQ).CQ, want, chunk)
	if err != nil {
		return nil, err
	}
	return &fpQP{QP: qp, fp: id.fp, id: id.CMID}, nil
}

func (id *fpID) Connect(p verbs.ConnParam) error {
	if id.fp.fire(fpConnect) {
		return errInjected("rdma_connect", syscall.ENOMEM)
	}
	return id.CMID.Connect(p)
}

func (id *fpID) Accept(p verbs.ConnParam) error {
	if id.fp.fire(fpAccept) {
		return errInjected("rdma_accept", syscall.ENOMEM)
	}
	return id.CMID.Accept(p)
}

// fpContext is a device context.
type fpContext struct {
	verbs.Context
	fp *failpoints
}

func (c *fpContext) AllocPD() (verbs.PD, error) {
	pd, err := c.Context.AllocPD()
	if err != nil {
		return nil, err
	}
	return &fpPD{PD: pd, fp: c.fp}, nil
}

func (c *fpContext) NewCQ(cqe int, ch verbs.CompChannel, batch, vector int) (verbs.CQ, error) {
	if c.fp.fire(fpCQCreate) {
		return nil, errInjected("ibv_create_cq", syscall.ENOMEM)
	}
	cq, err := c.Context.NewCQ(cqe, ch, batch, vector)
	if err != nil {
		return nil, err
	}
	return &fpCQ{CQ: cq, fp: c.fp}, nil
}

// fpPD is a protection domain; its MRs and MWs are the device's own.
type fpPD struct {
	verbs.PD
	fp *failpoints
}

func (pd *fpPD) AllocMW() (verbs.MW, error) {
	if pd.fp.fire(fpMWAlloc) {
		return nil, errInjected("ibv_alloc_mw", syscall.ENOMEM)
	}
	return pd.PD.AllocMW()
}

// fpQP is a queue pair; id is its (inner) CM id.
type fpQP struct {
	verbs.QP
	fp *failpoints
	id verbs.CMID
}

// refuse posts a random prefix of a chain of n with post, and reports the
// rest refused with ENOMEM, as a device does when its queue is full.
func (qp *fpQP) refuse(op string, n int, post func(int) (int, error)) (int, error) {
	k := qp.fp.intn(n)
	if k > 0 {
		if got, err := post(k); err != nil {
			return got, err
		}
	}
	return k, errInjected(op, syscall.ENOMEM)
}

// disconnectMidIO disconnects the connection for real, after a post.
func (qp *fpQP) disconnectMidIO() {
	if qp.fp.fire(fpDisconnectMidIO) {
		if err := qp.id.Disconnect(); err != nil {
			qp.fp.log.Warn("rdma failpoint: rdma_disconnect", zap.Error(err))
		}
	}
}

func (qp *fpQP) PostSend(n int) (int, error) {
	if n > 0 && qp.fp.fire(fpPostSend, zap.Int("chain", n)) {
		return qp.refuse("ibv_post_send", n, qp.QP.PostSend)
	}
	k, err := qp.QP.PostSend(n)
	if err == nil {
		qp.disconnectMidIO()
	}
	return k, err
}

func (qp *fpQP) PostRecv(n int) (int, error) {
	if n > 0 && qp.fp.fire(fpPostRecv, zap.Int("chain", n)) {
		return qp.refuse("ibv_post_recv", n, qp.QP.PostRecv)
	}
	return qp.QP.PostRecv(n)
}

func (qp *fpQP) PostBindMW(id uint64, mw verbs.MW, mr verbs.MR, addr, length uint64, access int, rkey uint32) error {
	if qp.fp.fire(fpMWBind) {
		return errInjected("ibv_post_send IBV_WR_BIND_MW", syscall.ENOMEM)
	}
	return qp.QP.PostBindMW(id, mw, mr, addr, length, access, rkey)
}

// fpCQ is a completion queue; failed: a completion was turned into an
// error, and the send completions after it are flushed. (Poll and
// PollSpin are called by one goroutine at a time: the conn's pollSem.)
type fpCQ struct {
	verbs.CQ
	fp     *failpoints
	failed bool
}

func (cq *fpCQ) Poll(max int, arm bool) (int, error) {
	k, err := cq.CQ.Poll(max, arm)
	if err == nil && k > 0 {
		cq.inject(cq.WCs()[:k])
	}
	return k, err
}

func (cq *fpCQ) PollSpin(max int, budget time.Duration) (int, error) {
	k, err := cq.CQ.PollSpin(max, budget)
	if err == nil && k > 0 {
		cq.inject(cq.WCs()[:k])
	}
	return k, err
}

// sendWC reports whether wc is the completion of a send-queue request of
// the link or of a memory window (not a receive, not the drain request).
func sendWC(wc *verbs.WC) bool { return wc.ID&recvBit == 0 && wc.ID != drainWRID }

// inject turns the first successful send completion of wcs into a
// RETRY_EXC_ERR when cq_error fires, and from then on every successful
// send completion into a flush.
func (cq *fpCQ) inject(wcs []verbs.WC) {
	for i := range wcs {
		wc := &wcs[i]
		if !sendWC(wc) || wc.Status != verbs.WCSuccess {
			continue
		}
		if cq.failed {
			wc.Status = verbs.WCWRFlushErr
			continue
		}
		if wc.ID&mwBit == 0 && cq.fp.fire(fpCQError, zap.Uint64("wr_id", wc.ID)) {
			wc.Status = verbs.WCRetryExcErr
			cq.failed = true
		}
	}
}
