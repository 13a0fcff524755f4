//go:build linux && cgo && rdma && rdmacfake

package verbs

// A QP without a device, for the tests of the C posting functions
// (verbs_test.go): built only with the tag rdmacfake, never into a
// program. Its context's post_send and post_recv record the wr_ids they
// take and refuse the request at a given index, as ibv_post_send and
// ibv_post_recv refuse one when the queue is full.

/*
#include <stdlib.h>
#include "verbs.h"

struct rblk_fake {
	struct ibv_context ctx;
	struct ibv_qp qp;
	struct ibv_pd pd;
	int fail_send_at, fail_recv_at; // -1: never
	int per_call; // the indexes count within each post, which all fail
	int err;
	int nsend, nrecv, cap;
	uint64_t *sent, *recvd;
};

static int rblk_fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
	struct rblk_fake *f = qp->qp_context;
	int i = 0;
	for (; wr; wr = wr->next, i++) {
		if (f->per_call ? i == f->fail_send_at : f->nsend == f->fail_send_at) {
			if (!f->per_call)
				f->fail_send_at = -1;
			*bad = wr;
			return f->err;
		}
		if (f->nsend < f->cap)
			f->sent[f->nsend] = wr->wr_id;
		f->nsend++;
	}
	return 0;
}

static int rblk_fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
	struct rblk_fake *f = qp->qp_context;
	int i = 0;
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

static struct rblk_fake *rblk_fake_new(int cap, int fail_send_at, int fail_recv_at, int per_call, int err) {
	struct rblk_fake *f = calloc(1, sizeof(*f));
	if (!f)
		return NULL;
	f->sent = calloc(cap, sizeof(uint64_t));
	f->recvd = calloc(cap, sizeof(uint64_t));
	if (!f->sent || !f->recvd) {
		free(f->sent);
		free(f->recvd);
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
	free(f);
}

static struct ibv_qp *rblk_fake_qp(struct rblk_fake *f) { return &f->qp; }
*/
import "C"

import (
	"errors"
	"slices"
	"syscall"
	"unsafe"
)

// fakeQPConfig says which requests a fake QP refuses.
type fakeQPConfig struct {
	// Chunk is the longest chain one PostSend or PostRecv posts.
	Chunk int
	// FailSendAt and FailRecvAt are the index (counted from 0 over the QP's
	// life) of the send or receive that the post refuses with Errno, once;
	// -1 for none.
	FailSendAt, FailRecvAt int
	// PerCall counts FailSendAt and FailRecvAt within each post instead,
	// and every post refuses the request at that index.
	PerCall bool
	// Errno is what the refused post returns (default ENOMEM).
	Errno syscall.Errno
	// Record is how many wr_ids of each queue are kept for posted.
	Record int
}

// fakeQP is a queuePair over a struct rblk_fake.
type fakeQP struct {
	*queuePair
	f *C.struct_rblk_fake
}

// newFakeQP returns a QP without a device whose posts record what they
// take and refuse the requests cfg names.
func newFakeQP(cfg fakeQPConfig) (*fakeQP, error) {
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
	qp := wrapQP(nil, C.rblk_fake_qp(f), bufs, cfg.Chunk, QPCaps{})
	qp.destroy = func() { C.rblk_fake_free(f) }
	return &fakeQP{queuePair: qp, f: f}, nil
}

// posted returns the wr_ids the fake QP took, sends and receives, in
// order (up to fakeQPConfig.Record of each).
func (qp *fakeQP) posted() (sends, recvs []uint64) {
	f := qp.f
	ns, nr := min(int(f.nsend), int(f.cap)), min(int(f.nrecv), int(f.cap))
	sends = slices.Clone(unsafe.Slice((*uint64)(unsafe.Pointer(f.sent)), int(f.cap))[:ns])
	recvs = slices.Clone(unsafe.Slice((*uint64)(unsafe.Pointer(f.recvd)), int(f.cap))[:nr])
	return sends, recvs
}
