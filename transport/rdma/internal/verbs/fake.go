//go:build linux && cgo && rdma

package verbs

/*
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

// rblk_fake is a queue pair without a device: its context's post_send and
// post_recv record the wr_ids they take, and refuse the request at a given
// index (counted over the QP's life), as ibv_post_send and ibv_post_recv
// refuse one when the queue is full.
struct rblk_fake {
	struct ibv_context ctx;
	struct ibv_qp qp;
	struct ibv_pd pd;
	int mws, mw_next; // windows allocated and not freed; keys given
	int fail_send_at, fail_recv_at; // -1: never
	int per_call; // the indexes count within each post, which all fail
	int err;
	int error_state;
	int nsend, nrecv, cap;
	int send_calls, recv_calls; // ibv_post_send and ibv_post_recv calls
	uint64_t *sent, *recvd;
	unsigned int *sent_flags; // send_flags of each send taken
};

static int rblk_fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
	struct rblk_fake *f = qp->qp_context;
	int i = 0;
	f->send_calls++;
	for (; wr; wr = wr->next, i++) {
		if (f->per_call ? i == f->fail_send_at : f->nsend == f->fail_send_at) {
			if (!f->per_call)
				f->fail_send_at = -1;
			*bad = wr;
			return f->err;
		}
		if (f->nsend < f->cap) {
			f->sent[f->nsend] = wr->wr_id;
			f->sent_flags[f->nsend] = wr->send_flags;
		}
		f->nsend++;
	}
	return 0;
}

static int rblk_fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
	struct rblk_fake *f = qp->qp_context;
	int i = 0;
	f->recv_calls++;
	for (; wr; wr = wr->next, i++) {
		if (f->per_call ? i == f->fail_recv_at : f->nrecv == f->fail_recv_at) {
			if (!f->per_call)
				f->fail_recv_at = -1;
			*bad = wr;
			return f->err;
		}
		if (f->nrecv < f->cap)
			f->recvd[f->nrecv] = wr->wr_id;
		f->nrecv++;
	}
	return 0;
}

static struct ibv_mw *rblk_fake_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type) {
	struct rblk_fake *f = (struct rblk_fake *)((char *)pd - offsetof(struct rblk_fake, pd));
	struct ibv_mw *mw = calloc(1, sizeof(*mw));
	if (!mw) {
		errno = ENOMEM;
		return NULL;
	}
	mw->context = pd->context;
	mw->pd = pd;
	mw->type = type;
	mw->rkey = (uint32_t)(++f->mw_next) << 8;
	f->mws++;
	return mw;
}

static int rblk_fake_dealloc_mw(struct ibv_mw *mw) {
	struct rblk_fake *f = (struct rblk_fake *)((char *)mw->pd - offsetof(struct rblk_fake, pd));
	f->mws--;
	free(mw);
	return 0;
}

static struct rblk_fake *rblk_fake_new(int cap, int fail_send_at, int fail_recv_at, int per_call, int err) {
	struct rblk_fake *f = calloc(1, sizeof(*f));
	if (!f)
		return NULL;
	f->sent = calloc(cap, sizeof(uint64_t));
	f->recvd = calloc(cap, sizeof(uint64_t));
	f->sent_flags = calloc(cap, sizeof(unsigned int));
	if (!f->sent || !f->recvd || !f->sent_flags) {
		free(f->sent);
		free(f->recvd);
		free(f->sent_flags);
		free(f);
		return NULL;
	}
	f->cap = cap;
	f->fail_send_at = fail_send_at;
	f->fail_recv_at = fail_recv_at;
	f->per_call = per_call;
	f->err = err;
	f->ctx.ops.post_send = rblk_fake_post_send;
	f->ctx.ops.post_recv = rblk_fake_post_recv;
	f->pd.context = &f->ctx;
	f->qp.pd = &f->pd;
	f->qp.context = &f->ctx;
	f->qp.qp_context = f;
	f->qp.qp_num = 1;
	return f;
}

static void rblk_fake_free(struct rblk_fake *f) {
	free(f->sent);
	free(f->recvd);
	free(f->sent_flags);
	free(f);
}

static struct ibv_qp *rblk_fake_qp(struct rblk_fake *f) { return &f->qp; }
static struct ibv_pd *rblk_fake_pd(struct rblk_fake *f) { return &f->pd; }

static void rblk_fake_set_mw(struct rblk_fake *f, int on) {
	f->ctx.ops.alloc_mw = on ? rblk_fake_alloc_mw : NULL;
	f->ctx.ops.dealloc_mw = on ? rblk_fake_dealloc_mw : NULL;
}
*/
import "C"

import (
	"errors"
	"slices"
	"syscall"
	"unsafe"
)

// fakeQP is the state of a QP of NewFakeQP.
type fakeQP struct {
	p *C.struct_rblk_fake
}

// FakeQPConfig says which requests a fake QP refuses.
type FakeQPConfig struct {
	// Chunk is the longest chain one PostSend or PostRecv posts.
	Chunk int
	// Caps are reported as the QP's.
	Caps QPCaps
	// FailSendAt and FailRecvAt are the index (counted from 0 over the QP's
	// life) of the send or receive that the post refuses with Errno, once;
	// -1 for none.
	FailSendAt, FailRecvAt int
	// PerCall counts FailSendAt and FailRecvAt within each post instead,
	// and every post refuses the request at that index.
	PerCall bool
	// Errno is what the refused post returns (default ENOMEM).
	Errno syscall.Errno
	// Record is how many wr_ids of each queue are kept for FakePosted.
	Record int
	// MW gives the QP's fake PD (FakePD) type-2 memory windows; without
	// it ibv_alloc_mw fails with EOPNOTSUPP.
	MW bool
}

// NewFakeQP returns a QP without a device, for tests of the posting logic
// above it: its posts record what they take and refuse the requests
// FakeQPConfig names. It completes nothing; ToError only marks it.
func NewFakeQP(cfg FakeQPConfig) (*QP, error) {
	if cfg.Errno == 0 {
		cfg.Errno = syscall.ENOMEM
	}
	perCall := C.int(0)
	if cfg.PerCall {
		perCall = 1
	}
	f := C.rblk_fake_new(C.int(max(cfg.Record, 1)), C.int(cfg.FailSendAt), C.int(cfg.FailRecvAt), perCall, C.int(cfg.Errno))
	if f == nil {
		return nil, errors.New("fake QP: out of memory")
	}
	bufs, err := newQPBufs(cfg.Chunk)
	if err != nil {
		C.rblk_fake_free(f)
		return nil, err
	}
	if cfg.MW {
		C.rblk_fake_set_mw(f, 1)
	}
	qp := wrapQP(nil, C.rblk_fake_qp(f), bufs, cfg.Chunk, cfg.Caps)
	qp.fake = &fakeQP{p: f}
	return qp, nil
}

// FakePD is the protection domain of a fake QP: it allocates fake memory
// windows if FakeQPConfig.MW. It is freed with the QP.
func (qp *QP) FakePD() *PD { return &PD{p: C.rblk_fake_pd(qp.fake.p)} }

// FakeMWs is the number of windows of FakePD allocated and not freed.
func (qp *QP) FakeMWs() int { return int(qp.fake.p.mws) }

// FakePosted returns the wr_ids a fake QP took, sends and receives, in
// order (up to FakeQPConfig.Record of each), and whether ToError was called.
func (qp *QP) FakePosted() (sends, recvs []uint64, errorState bool) {
	f := qp.fake.p
	ns, nr := min(int(f.nsend), int(f.cap)), min(int(f.nrecv), int(f.cap))
	sends = slices.Clone(unsafe.Slice((*uint64)(unsafe.Pointer(f.sent)), int(f.cap))[:ns])
	recvs = slices.Clone(unsafe.Slice((*uint64)(unsafe.Pointer(f.recvd)), int(f.cap))[:nr])
	return sends, recvs, f.error_state != 0
}

// FakeSendFlags returns the send_flags of the sends a fake QP took, in
// order (up to FakeQPConfig.Record).
func (qp *QP) FakeSendFlags() []uint32 {
	f := qp.fake.p
	ns := min(int(f.nsend), int(f.cap))
	flags := make([]uint32, ns)
	for i, v := range unsafe.Slice((*C.uint)(unsafe.Pointer(f.sent_flags)), int(f.cap))[:ns] {
		flags[i] = uint32(v)
	}
	return flags
}

// FakePostCalls returns how many times ibv_post_send and ibv_post_recv
// were called on a fake QP.
func (qp *QP) FakePostCalls() (sends, recvs int) {
	return int(qp.fake.p.send_calls), int(qp.fake.p.recv_calls)
}

func (f *fakeQP) toError() error {
	f.p.error_state = 1
	return nil
}

func (f *fakeQP) destroy() {
	C.rblk_fake_free(f.p)
	f.p = nil
}
