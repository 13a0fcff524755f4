//go:build linux && cgo && rdma

package verbs

/*
#cgo LDFLAGS: -libverbs -lrdmacm
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

// rblk_wr is one work request as Go fills it (see WR).
struct rblk_wr {
	uint64_t wr_id;
	uint64_t addr;
	uint64_t raddr;
	uint32_t length;
	uint32_t lkey;
	uint32_t rkey;
	uint32_t imm;
	uint32_t opcode;
	uint32_t flags;
};

// rblk_wc is one completion as Go reads it (see WC).
struct rblk_wc {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t byte_len;
	uint32_t imm;
	uint32_t vendor_err;
	uint32_t wc_flags;
};

enum {
	RBLK_WR_SIZE = sizeof(struct rblk_wr),
	RBLK_WR_OPCODE = offsetof(struct rblk_wr, opcode),
	RBLK_WC_SIZE = sizeof(struct rblk_wc),
	RBLK_WC_VENDOR = offsetof(struct rblk_wc, vendor_err),
};

// rblk_qp_bufs are the arrays a QP posts from, allocated with it.
struct rblk_qp_bufs {
	int chunk;
	// Of the last post that failed, how many went before the one refused:
	// one counter per queue, as sends and receives are posted under
	// different locks (a shared one could be overwritten by the other
	// queue's post before it is read).
	int send_posted;
	int recv_posted;
	struct rblk_wr *send_in;
	struct ibv_send_wr *send_wr;
	struct ibv_sge *send_sge;
	struct rblk_wr *recv_in;
	struct ibv_recv_wr *recv_wr;
	struct ibv_sge *recv_sge;
};

static void rblk_free_qp_bufs(struct rblk_qp_bufs *b) {
	if (!b)
		return;
	free(b->send_in);
	free(b->send_wr);
	free(b->send_sge);
	free(b->recv_in);
	free(b->recv_wr);
	free(b->recv_sge);
	free(b);
}

static struct rblk_qp_bufs *rblk_alloc_qp_bufs(int chunk) {
	struct rblk_qp_bufs *b = calloc(1, sizeof(*b));
	if (!b)
		return NULL;
	b->chunk = chunk;
	b->send_in = calloc(chunk, sizeof(struct rblk_wr));
	b->send_wr = calloc(chunk, sizeof(struct ibv_send_wr));
	b->send_sge = calloc(chunk, sizeof(struct ibv_sge));
	b->recv_in = calloc(chunk, sizeof(struct rblk_wr));
	b->recv_wr = calloc(chunk, sizeof(struct ibv_recv_wr));
	b->recv_sge = calloc(chunk, sizeof(struct ibv_sge));
	if (!b->send_in || !b->send_wr || !b->send_sge || !b->recv_in || !b->recv_wr || !b->recv_sge) {
		rblk_free_qp_bufs(b);
		return NULL;
	}
	return b;
}

// rblk_post_send posts send_in[0:n] as one chain with one ibv_post_send.
// It returns 0, or the error of ibv_post_send with b->send_posted set to
// the number of requests before the one that failed.
static int rblk_post_send(struct ibv_qp *qp, struct rblk_qp_bufs *b, int n) {
	int i, ret;
	struct ibv_send_wr *bad = NULL;

	for (i = 0; i < n; i++) {
		const struct rblk_wr *in = &b->send_in[i];
		struct ibv_send_wr *wr = &b->send_wr[i];
		struct ibv_sge *sge = &b->send_sge[i];

		memset(wr, 0, sizeof(*wr));
		wr->wr_id = in->wr_id;
		wr->next = i + 1 < n ? &b->send_wr[i + 1] : NULL;
		if (in->length) {
			sge->addr = in->addr;
			sge->length = in->length;
			sge->lkey = in->lkey;
			wr->sg_list = sge;
			wr->num_sge = 1;
		}
		wr->opcode = (enum ibv_wr_opcode)in->opcode;
		wr->send_flags = in->flags;
		wr->imm_data = htonl(in->imm);
		wr->wr.rdma.remote_addr = in->raddr;
		wr->wr.rdma.rkey = in->rkey;
	}
	ret = ibv_post_send(qp, b->send_wr, &bad);
	b->send_posted = ret ? (bad ? (int)(bad - b->send_wr) : 0) : n;
	return ret;
}

// rblk_post_recv is rblk_post_send for receives; b->recv_posted counts.
static int rblk_post_recv(struct ibv_qp *qp, struct rblk_qp_bufs *b, int n) {
	int i, ret;
	struct ibv_recv_wr *bad = NULL;

	for (i = 0; i < n; i++) {
		const struct rblk_wr *in = &b->recv_in[i];
		struct ibv_recv_wr *wr = &b->recv_wr[i];
		struct ibv_sge *sge = &b->recv_sge[i];

		memset(wr, 0, sizeof(*wr));
		wr->wr_id = in->wr_id;
		wr->next = i + 1 < n ? &b->recv_wr[i + 1] : NULL;
		if (in->length) {
			sge->addr = in->addr;
			sge->length = in->length;
			sge->lkey = in->lkey;
			wr->sg_list = sge;
			wr->num_sge = 1;
		}
	}
	ret = ibv_post_recv(qp, b->recv_wr, &bad);
	b->recv_posted = ret ? (bad ? (int)(bad - b->recv_wr) : 0) : n;
	return ret;
}

static void rblk_convert(const struct ibv_wc *wc, struct rblk_wc *out, int n) {
	int i;
	for (i = 0; i < n; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].opcode = wc[i].opcode;
		out[i].byte_len = wc[i].byte_len;
		out[i].imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
		out[i].vendor_err = wc[i].vendor_err;
		out[i].wc_flags = wc[i].wc_flags;
	}
}

// rblk_poll polls up to n completions. With arm set and nothing found, it
// requests a notification and polls again (a completion that came between
// the poll and the request raises no event). It returns the count or
// -errno.
static int rblk_poll(struct ibv_cq *cq, struct ibv_wc *wc, struct rblk_wc *out, int n, int arm) {
	int k, ret;

	k = ibv_poll_cq(cq, n, wc);
	if (k == 0 && arm) {
		ret = ibv_req_notify_cq(cq, 0);
		if (ret)
			return -ret;
		k = ibv_poll_cq(cq, n, wc);
	}
	if (k < 0)
		return -EIO;
	rblk_convert(wc, out, k);
	return k;
}

// rblk_poll_spin polls until it finds completions or budget_ns elapsed.
static int rblk_poll_spin(struct ibv_cq *cq, struct ibv_wc *wc, struct rblk_wc *out, int n, int64_t budget_ns) {
	struct timespec start, now;
	int k, i = 0;

	clock_gettime(CLOCK_MONOTONIC, &start);
	for (;;) {
		k = ibv_poll_cq(cq, n, wc);
		if (k != 0)
			break;
		if ((++i & 63) == 0) {
			clock_gettime(CLOCK_MONOTONIC, &now);
			if ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) >= budget_ns)
				return 0;
		}
	}
	if (k < 0)
		return -EIO;
	rblk_convert(wc, out, k);
	return k;
}

// rblk_get_cq_event consumes one completion event without blocking (the
// channel's fd is non-blocking): 1 if one was there, 0 if not, -errno.
static int rblk_get_cq_event(struct ibv_comp_channel *ch) {
	struct ibv_cq *cq;
	void *ctx;

	if (ibv_get_cq_event(ch, &cq, &ctx))
		return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
	return 1;
}

// rblk_event is a connection manager event copied out of librdmacm's, which
// is acknowledged at once.
struct rblk_event {
	struct rdma_cm_id *id;
	struct rdma_cm_id *listen_id;
	int event;
	int status;
	int private_data_len;
	uint8_t responder_resources;
	uint8_t initiator_depth;
	uint8_t flow_control;
	uint8_t retry_count;
	uint8_t rnr_retry_count;
	uint8_t private_data[256];
};

static int rblk_get_event(struct rdma_event_channel *ch, struct rblk_event *out) {
	struct rdma_cm_event *ev;
	const struct rdma_conn_param *p;

	if (rdma_get_cm_event(ch, &ev))
		return errno;
	memset(out, 0, sizeof(*out));
	out->id = ev->id;
	out->listen_id = ev->listen_id;
	out->event = ev->event;
	out->status = ev->status;
	switch (ev->event) {
	case RDMA_CM_EVENT_CONNECT_REQUEST:
	case RDMA_CM_EVENT_CONNECT_RESPONSE:
	case RDMA_CM_EVENT_ESTABLISHED:
	case RDMA_CM_EVENT_REJECTED:
		p = &ev->param.conn;
		out->responder_resources = p->responder_resources;
		out->initiator_depth = p->initiator_depth;
		out->flow_control = p->flow_control;
		out->retry_count = p->retry_count;
		out->rnr_retry_count = p->rnr_retry_count;
		if (p->private_data && p->private_data_len) {
			out->private_data_len = p->private_data_len;
			memcpy(out->private_data, p->private_data, p->private_data_len);
		}
		break;
	default:
		break;
	}
	rdma_ack_cm_event(ev);
	return 0;
}

static void rblk_sockaddr(struct sockaddr_storage *ss, int v6, const uint8_t *ip, uint16_t port) {
	memset(ss, 0, sizeof(*ss));
	if (v6) {
		struct sockaddr_in6 *s = (struct sockaddr_in6 *)ss;
		s->sin6_family = AF_INET6;
		s->sin6_port = htons(port);
		memcpy(&s->sin6_addr, ip, 16);
	} else {
		struct sockaddr_in *s = (struct sockaddr_in *)ss;
		s->sin_family = AF_INET;
		s->sin_port = htons(port);
		memcpy(&s->sin_addr, ip, 4);
	}
}

// rblk_addr reads a socket address: 4 or 6, or 0 if it is neither.
static int rblk_addr(const struct sockaddr *sa, uint8_t *ip, uint16_t *port) {
	if (!sa)
		return 0;
	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s = (const struct sockaddr_in *)sa;
		memcpy(ip, &s->sin_addr, 4);
		*port = ntohs(s->sin_port);
		return 4;
	}
	if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)sa;
		memcpy(ip, &s->sin6_addr, 16);
		*port = ntohs(s->sin6_port);
		return 6;
	}
	return 0;
}

static int rblk_local_addr(struct rdma_cm_id *id, uint8_t *ip, uint16_t *port) {
	return rblk_addr(rdma_get_local_addr(id), ip, port);
}

static int rblk_peer_addr(struct rdma_cm_id *id, uint8_t *ip, uint16_t *port) {
	return rblk_addr(rdma_get_peer_addr(id), ip, port);
}

static const char *rblk_device_name(struct rdma_cm_id *id) {
	if (!id->verbs || !id->verbs->device)
		return "";
	return ibv_get_device_name(id->verbs->device);
}

static void rblk_sgid(struct rdma_cm_id *id, uint8_t *gid) {
	memcpy(gid, id->route.addr.addr.ibaddr.sgid.raw, 16);
}

static int rblk_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq,
			  uint32_t send_wr, uint32_t recv_wr, uint32_t inline_data, struct ibv_qp_cap *cap) {
	struct ibv_qp_init_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.send_cq = cq;
	attr.recv_cq = cq;
	attr.qp_type = IBV_QPT_RC;
	// Selective signaling: a send request completes only if it carries
	// IBV_SEND_SIGNALED, or fails.
	attr.sq_sig_all = 0;
	attr.cap.max_send_wr = send_wr;
	attr.cap.max_recv_wr = recv_wr;
	attr.cap.max_send_sge = 1;
	attr.cap.max_recv_sge = 1;
	attr.cap.max_inline_data = inline_data;
	if (rdma_create_qp(id, pd, &attr))
		return errno;
	*cap = attr.cap;
	return 0;
}

static int rblk_connect(struct rdma_cm_id *id, int accept, const void *pd, uint8_t pdlen,
			uint8_t resp_res, uint8_t init_depth, uint8_t flow_control, uint8_t retry, uint8_t rnr_retry) {
	struct rdma_conn_param p;

	memset(&p, 0, sizeof(p));
	p.private_data = pdlen ? pd : NULL;
	p.private_data_len = pdlen;
	p.responder_resources = resp_res;
	p.initiator_depth = init_depth;
	p.flow_control = flow_control;
	p.retry_count = retry;
	p.rnr_retry_count = rnr_retry;
	if (accept ? rdma_accept(id, &p) : rdma_connect(id, &p))
		return errno;
	return 0;
}

static int rblk_set_min_rnr_timer(struct ibv_qp *qp, uint8_t timer) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.min_rnr_timer = timer;
	return ibv_modify_qp(qp, &attr, IBV_QP_MIN_RNR_TIMER);
}

static int rblk_qp_to_error(struct ibv_qp *qp) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &attr, IBV_QP_STATE);
}

// rblk_alloc_mw is ibv_alloc_mw of a type-2 window; NULL with errno set.
static struct ibv_mw *rblk_alloc_mw(struct ibv_pd *pd) {
	return ibv_alloc_mw(pd, IBV_MW_TYPE_2);
}

static int rblk_dealloc_mw(struct ibv_mw *mw) { return ibv_dealloc_mw(mw); }

// rblk_post_bind_mw posts one signaled IBV_WR_BIND_MW of the type-2 window
// mw over [addr, addr+length) of mr, under the new rkey (whose 8 low bits
// the caller chose with ibv_inc_rkey). Once posted, mw->rkey is the new
// one: the next bind names the window by it (rxe checks that it is the
// window's current key).
static int rblk_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, struct ibv_mr *mr,
			     uint64_t addr, uint64_t length, unsigned int access, uint32_t rkey) {
	struct ibv_send_wr wr, *bad = NULL;
	int ret;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.opcode = IBV_WR_BIND_MW;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = rkey;
	wr.bind_mw.bind_info.mr = mr;
	wr.bind_mw.bind_info.addr = addr;
	wr.bind_mw.bind_info.length = length;
	wr.bind_mw.bind_info.mw_access_flags = access;
	ret = ibv_post_send(qp, &wr, &bad);
	if (ret == 0)
		mw->rkey = rkey;
	return ret;
}

// rblk_post_local_inv posts one signaled IBV_WR_LOCAL_INV of rkey.
static int rblk_post_local_inv(struct ibv_qp *qp, uint64_t wr_id, uint32_t rkey) {
	struct ibv_send_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.opcode = IBV_WR_LOCAL_INV;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.invalidate_rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

// rblk_post_drain posts one signaled zero-length IBV_WR_RDMA_WRITE: on a
// QP in the error state it completes flushed after everything posted
// before it; on a working QP it executes (a zero-length RDMA WRITE names
// no memory: the peer checks no key, IBA C9-88) and completes after
// everything before it.
static int rblk_post_drain(struct ibv_qp *qp, uint64_t wr_id) {
	struct ibv_send_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.send_flags = IBV_SEND_SIGNALED;
	return ibv_post_send(qp, &wr, &bad);
}

static uint32_t rblk_inc_rkey(uint32_t rkey) { return ibv_inc_rkey(rkey); }
static int rblk_num_comp_vectors(struct ibv_context *c) { return c->num_comp_vectors; }

static struct ibv_context *rblk_id_verbs(struct rdma_cm_id *id) { return id->verbs; }
static struct ibv_qp *rblk_id_qp(struct rdma_cm_id *id) { return id->qp; }
static uint8_t rblk_id_port(struct rdma_cm_id *id) { return id->port_num; }
static uint32_t rblk_qp_num(struct ibv_qp *qp) { return qp->qp_num; }
*/
import "C"

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"
	"unsafe"
)

// WR is a work request as the C side reads it: a span of a registered
// region (Addr, Length, LKey), the peer's memory for one-sided operations
// (RAddr, RKey), immediate data in host order, an ibv_wr_opcode and
// ibv_send_flags. Its layout is that of struct rblk_wr.
type WR struct {
	ID     uint64
	Addr   uint64
	RAddr  uint64
	Length uint32
	LKey   uint32
	RKey   uint32
	Imm    uint32
	Opcode uint32
	Flags  uint32
}

// WC is a completion as the C side writes it: Imm in host order. Its layout
// is that of struct rblk_wc.
type WC struct {
	ID        uint64
	Status    uint32
	Opcode    uint32
	ByteLen   uint32
	Imm       uint32
	VendorErr uint32
	Flags     uint32
}

func init() {
	if unsafe.Sizeof(WR{}) != C.RBLK_WR_SIZE || unsafe.Offsetof(WR{}.Opcode) != C.RBLK_WR_OPCODE ||
		unsafe.Sizeof(WC{}) != C.RBLK_WC_SIZE || unsafe.Offsetof(WC{}.VendorErr) != C.RBLK_WC_VENDOR {
		panic("verbs: Go and C layouts of work requests or completions differ")
	}
}

// Work request opcodes and flags (ibv_wr_opcode, ibv_send_flags).
const (
	WRSend         = C.IBV_WR_SEND
	WRRDMAWrite    = C.IBV_WR_RDMA_WRITE
	WRRDMAWriteImm = C.IBV_WR_RDMA_WRITE_WITH_IMM
	WRRDMARead     = C.IBV_WR_RDMA_READ

	FlagSignaled = C.IBV_SEND_SIGNALED
	FlagInline   = C.IBV_SEND_INLINE
)

// Completion opcodes (ibv_wc_opcode) of receives, and wc_flags.
const (
	WCRecv            = C.IBV_WC_RECV
	WCRecvRDMAWithImm = C.IBV_WC_RECV_RDMA_WITH_IMM
	WCFlagWithImm     = C.IBV_WC_WITH_IMM
)

// Access flags (ibv_access_flags).
const (
	AccessLocalWrite  = C.IBV_ACCESS_LOCAL_WRITE
	AccessRemoteWrite = C.IBV_ACCESS_REMOTE_WRITE
	AccessRemoteRead  = C.IBV_ACCESS_REMOTE_READ
	AccessMWBind      = C.IBV_ACCESS_MW_BIND
)

// Completion opcodes (ibv_wc_opcode) of memory window requests.
const (
	WCBindMW   = C.IBV_WC_BIND_MW
	WCLocalInv = C.IBV_WC_LOCAL_INV
)

// Completion statuses (ibv_wc_status).
const (
	WCSuccess        = C.IBV_WC_SUCCESS
	WCLocLenErr      = C.IBV_WC_LOC_LEN_ERR
	WCLocQPOpErr     = C.IBV_WC_LOC_QP_OP_ERR
	WCLocProtErr     = C.IBV_WC_LOC_PROT_ERR
	WCWRFlushErr     = C.IBV_WC_WR_FLUSH_ERR
	WCRemInvReqErr   = C.IBV_WC_REM_INV_REQ_ERR
	WCRemAccessErr   = C.IBV_WC_REM_ACCESS_ERR
	WCRetryExcErr    = C.IBV_WC_RETRY_EXC_ERR
	WCRNRRetryExcErr = C.IBV_WC_RNR_RETRY_EXC_ERR
)

// StatusString is ibv_wc_status_str.
func StatusString(status uint32) string {
	return C.GoString(C.ibv_wc_status_str(C.enum_ibv_wc_status(status)))
}

// errnoErr wraps the errno value e, or EIO if it is 0.
func errnoErr(op string, e C.int) error {
	if e == 0 {
		e = C.EIO
	}
	return fmt.Errorf("%s: %w", op, syscall.Errno(e))
}

// callErr turns the errno cgo reports with a failed call into an error.
func callErr(op string, err error) error {
	if err == nil {
		err = syscall.EIO
	}
	return fmt.Errorf("%s: %w", op, err)
}

// Connection manager event types (rdma_cm_event_type).
type EventType int

const (
	EventAddrResolved    EventType = C.RDMA_CM_EVENT_ADDR_RESOLVED
	EventAddrError       EventType = C.RDMA_CM_EVENT_ADDR_ERROR
	EventRouteResolved   EventType = C.RDMA_CM_EVENT_ROUTE_RESOLVED
	EventRouteError      EventType = C.RDMA_CM_EVENT_ROUTE_ERROR
	EventConnectRequest  EventType = C.RDMA_CM_EVENT_CONNECT_REQUEST
	EventConnectResponse EventType = C.RDMA_CM_EVENT_CONNECT_RESPONSE
	EventConnectError    EventType = C.RDMA_CM_EVENT_CONNECT_ERROR
	EventUnreachable     EventType = C.RDMA_CM_EVENT_UNREACHABLE
	EventRejected        EventType = C.RDMA_CM_EVENT_REJECTED
	EventEstablished     EventType = C.RDMA_CM_EVENT_ESTABLISHED
	EventDisconnected    EventType = C.RDMA_CM_EVENT_DISCONNECTED
	EventDeviceRemoval   EventType = C.RDMA_CM_EVENT_DEVICE_REMOVAL
	EventAddrChange      EventType = C.RDMA_CM_EVENT_ADDR_CHANGE
	EventTimewaitExit    EventType = C.RDMA_CM_EVENT_TIMEWAIT_EXIT
)

func (t EventType) String() string {
	return C.GoString(C.rdma_event_str(C.enum_rdma_cm_event_type(t)))
}

// ConnParam is what a connect, accept or reject carries, and what the
// connection events report of the peer's.
type ConnParam struct {
	PrivateData        []byte
	ResponderResources uint8
	InitiatorDepth     uint8
	FlowControl        uint8
	RetryCount         uint8
	RNRRetryCount      uint8
}

// Event is a connection manager event, already acknowledged.
type Event struct {
	Type     EventType
	Status   int
	ID       *CMID
	ListenID *CMID
	Conn     ConnParam
}

// EventChannel is an rdma_event_channel whose fd is non-blocking.
type EventChannel struct {
	p  *C.struct_rdma_event_channel
	ev *C.struct_rblk_event
}

// NewEventChannel creates an event channel and makes its fd non-blocking.
func NewEventChannel() (*EventChannel, error) {
	p, err := C.rdma_create_event_channel()
	if p == nil {
		if err == nil {
			err = syscall.ENODEV
		}
		return nil, callErr("rdma_create_event_channel", err)
	}
	if err := syscall.SetNonblock(int(p.fd), true); err != nil {
		C.rdma_destroy_event_channel(p)
		return nil, fmt.Errorf("rdma event channel: set non-blocking: %w", err)
	}
	ev := (*C.struct_rblk_event)(C.calloc(1, C.sizeof_struct_rblk_event))
	if ev == nil {
		C.rdma_destroy_event_channel(p)
		return nil, errors.New("rdma event channel: out of memory")
	}
	return &EventChannel{p: p, ev: ev}, nil
}

// Fd is the channel's file descriptor, readable when an event is queued.
func (ch *EventChannel) Fd() int { return int(ch.p.fd) }

// Destroy destroys the channel. Its ids must be destroyed or migrated.
func (ch *EventChannel) Destroy() {
	if ch.p != nil {
		C.rdma_destroy_event_channel(ch.p)
		C.free(unsafe.Pointer(ch.ev))
		ch.p, ch.ev = nil, nil
	}
}

// GetEvent takes the next event without blocking: syscall.EAGAIN when
// there is none. One goroutine at a time may call it.
func (ch *EventChannel) GetEvent() (Event, error) {
	if e := C.rblk_get_event(ch.p, ch.ev); e != 0 {
		if e == C.EAGAIN {
			return Event{}, syscall.EAGAIN
		}
		return Event{}, errnoErr("rdma_get_cm_event", e)
	}
	ev := ch.ev
	out := Event{
		Type:   EventType(ev.event),
		Status: int(ev.status),
		ID:     wrapID(ev.id),
		Conn: ConnParam{
			ResponderResources: uint8(ev.responder_resources),
			InitiatorDepth:     uint8(ev.initiator_depth),
			FlowControl:        uint8(ev.flow_control),
			RetryCount:         uint8(ev.retry_count),
			RNRRetryCount:      uint8(ev.rnr_retry_count),
		},
	}
	if ev.listen_id != nil {
		out.ListenID = wrapID(ev.listen_id)
	}
	if n := int(ev.private_data_len); n > 0 {
		out.Conn.PrivateData = C.GoBytes(unsafe.Pointer(&ev.private_data[0]), C.int(min(n, len(ev.private_data))))
	}
	return out, nil
}

// CMID is an rdma_cm_id of the TCP port space (reliable connections).
type CMID struct {
	p *C.struct_rdma_cm_id
}

func wrapID(p *C.struct_rdma_cm_id) *CMID {
	if p == nil {
		return nil
	}
	return &CMID{p: p}
}

// NewID creates an id whose events go to ch.
func NewID(ch *EventChannel) (*CMID, error) {
	var p *C.struct_rdma_cm_id
	if r, err := C.rdma_create_id(ch.p, &p, nil, C.RDMA_PS_TCP); r != 0 {
		return nil, callErr("rdma_create_id", err)
	}
	return &CMID{p: p}, nil
}

// Is reports whether id and o are the same rdma_cm_id.
func (id *CMID) Is(o *CMID) bool { return id != nil && o != nil && id.p == o.p }

func sockaddr(ap netip.AddrPort) C.struct_sockaddr_storage {
	var ss C.struct_sockaddr_storage
	a := ap.Addr().Unmap()
	if a.Is4() {
		ip := a.As4()
		C.rblk_sockaddr(&ss, 0, (*C.uint8_t)(&ip[0]), C.uint16_t(ap.Port()))
	} else {
		ip := a.As16()
		C.rblk_sockaddr(&ss, 1, (*C.uint8_t)(&ip[0]), C.uint16_t(ap.Port()))
	}
	return ss
}

// Bind is rdma_bind_addr.
func (id *CMID) Bind(ap netip.AddrPort) error {
	ss := sockaddr(ap)
	if r, err := C.rdma_bind_addr(id.p, (*C.struct_sockaddr)(unsafe.Pointer(&ss))); r != 0 {
		return callErr("rdma_bind_addr "+ap.String(), err)
	}
	return nil
}

// Listen is rdma_listen.
func (id *CMID) Listen(backlog int) error {
	if r, err := C.rdma_listen(id.p, C.int(backlog)); r != 0 {
		return callErr("rdma_listen", err)
	}
	return nil
}

// ResolveAddr is rdma_resolve_addr; EventAddrResolved or EventAddrError follows.
func (id *CMID) ResolveAddr(dst netip.AddrPort, timeout time.Duration) error {
	ss := sockaddr(dst)
	if r, err := C.rdma_resolve_addr(id.p, nil, (*C.struct_sockaddr)(unsafe.Pointer(&ss)), C.int(timeout.Milliseconds())); r != 0 {
		return callErr("rdma_resolve_addr "+dst.String(), err)
	}
	return nil
}

// ResolveRoute is rdma_resolve_route; EventRouteResolved or EventRouteError follows.
func (id *CMID) ResolveRoute(timeout time.Duration) error {
	if r, err := C.rdma_resolve_route(id.p, C.int(timeout.Milliseconds())); r != 0 {
		return callErr("rdma_resolve_route", err)
	}
	return nil
}

// Migrate is rdma_migrate_id: the id's events go to ch from now on.
func (id *CMID) Migrate(ch *EventChannel) error {
	if r, err := C.rdma_migrate_id(id.p, ch.p); r != 0 {
		return callErr("rdma_migrate_id", err)
	}
	return nil
}

func (id *CMID) connect(accept bool, p ConnParam) error {
	var pd unsafe.Pointer
	if len(p.PrivateData) > 0 {
		// Copied into the command by librdmacm during the call.
		pd = unsafe.Pointer(&p.PrivateData[0])
	}
	acc := C.int(0)
	op := "rdma_connect"
	if accept {
		acc, op = 1, "rdma_accept"
	}
	if e := C.rblk_connect(id.p, acc, pd, C.uint8_t(len(p.PrivateData)), C.uint8_t(p.ResponderResources),
		C.uint8_t(p.InitiatorDepth), C.uint8_t(p.FlowControl), C.uint8_t(p.RetryCount), C.uint8_t(p.RNRRetryCount)); e != 0 {
		return errnoErr(op, e)
	}
	return nil
}

// Connect is rdma_connect; the id must have its QP.
func (id *CMID) Connect(p ConnParam) error { return id.connect(false, p) }

// Accept is rdma_accept; the id must have its QP.
func (id *CMID) Accept(p ConnParam) error { return id.connect(true, p) }

// Reject is rdma_reject.
func (id *CMID) Reject(privateData []byte) error {
	var pd unsafe.Pointer
	if len(privateData) > 0 {
		pd = unsafe.Pointer(&privateData[0])
	}
	if r, err := C.rdma_reject(id.p, pd, C.uint8_t(len(privateData))); r != 0 {
		return callErr("rdma_reject", err)
	}
	return nil
}

// Disconnect is rdma_disconnect: the QP moves to the error state (which
// flushes its work requests) and the peer is told.
func (id *CMID) Disconnect() error {
	if r, err := C.rdma_disconnect(id.p); r != 0 {
		return callErr("rdma_disconnect", err)
	}
	return nil
}

// Destroy is rdma_destroy_id. The QP must be destroyed first.
func (id *CMID) Destroy() error {
	if id.p == nil {
		return nil
	}
	r, err := C.rdma_destroy_id(id.p)
	id.p = nil
	if r != 0 {
		return callErr("rdma_destroy_id", err)
	}
	return nil
}

// Context is the device context the id is bound to, or nil.
func (id *CMID) Context() *Context {
	p := C.rblk_id_verbs(id.p)
	if p == nil {
		return nil
	}
	return &Context{p: p}
}

func addrPort(fam C.int, ip *[16]byte, port C.uint16_t) netip.AddrPort {
	switch fam {
	case 4:
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(ip[:4])), uint16(port))
	case 6:
		return netip.AddrPortFrom(netip.AddrFrom16(*ip).Unmap(), uint16(port))
	}
	return netip.AddrPort{}
}

// LocalAddr is rdma_get_local_addr.
func (id *CMID) LocalAddr() netip.AddrPort {
	var ip [16]byte
	var port C.uint16_t
	fam := C.rblk_local_addr(id.p, (*C.uint8_t)(&ip[0]), &port)
	return addrPort(fam, &ip, port)
}

// PeerAddr is rdma_get_peer_addr.
func (id *CMID) PeerAddr() netip.AddrPort {
	var ip [16]byte
	var port C.uint16_t
	fam := C.rblk_peer_addr(id.p, (*C.uint8_t)(&ip[0]), &port)
	return addrPort(fam, &ip, port)
}

// DeviceName is the name of the device the id is bound to, or "".
func (id *CMID) DeviceName() string { return C.GoString(C.rblk_device_name(id.p)) }

// Port is the device port the id is bound to.
func (id *CMID) Port() int { return int(C.rblk_id_port(id.p)) }

// SGID is the source GID of the id's route.
func (id *CMID) SGID() [16]byte {
	var gid [16]byte
	C.rblk_sgid(id.p, (*C.uint8_t)(&gid[0]))
	return gid
}

// QPCaps are the sizes of a queue pair.
type QPCaps struct {
	SendWR, RecvWR, InlineData int
}

// CreateQP is rdma_create_qp: an RC QP on pd whose send and receive queues
// complete on cq, with selective signaling (sq_sig_all = 0: a send request
// completes only with FlagSignaled, or when it fails). It allocates the
// arrays chains of up to chunk requests are posted from.
func (id *CMID) CreateQP(pd *PD, cq *CQ, want QPCaps, chunk int) (*QP, error) {
	bufs, err := newQPBufs(chunk)
	if err != nil {
		return nil, err
	}
	var caps C.struct_ibv_qp_cap
	if e := C.rblk_create_qp(id.p, pd.p, cq.p, C.uint32_t(want.SendWR), C.uint32_t(want.RecvWR), C.uint32_t(want.InlineData), &caps); e != 0 {
		C.rblk_free_qp_bufs(bufs)
		return nil, errnoErr("rdma_create_qp", e)
	}
	caps2 := QPCaps{SendWR: int(caps.max_send_wr), RecvWR: int(caps.max_recv_wr), InlineData: int(caps.max_inline_data)}
	return wrapQP(id, C.rblk_id_qp(id.p), bufs, chunk, caps2), nil
}

func wrapQP(id *CMID, p *C.struct_ibv_qp, bufs *C.struct_rblk_qp_bufs, chunk int, caps QPCaps) *QP {
	qp := &QP{id: id, p: p, bufs: bufs, chunk: chunk, Caps: caps}
	qp.send = unsafe.Slice((*WR)(unsafe.Pointer(bufs.send_in)), chunk)
	qp.recv = unsafe.Slice((*WR)(unsafe.Pointer(bufs.recv_in)), chunk)
	return qp
}

// newQPBufs allocates the posting arrays of a QP.
func newQPBufs(chunk int) (*C.struct_rblk_qp_bufs, error) {
	bufs := C.rblk_alloc_qp_bufs(C.int(chunk))
	if bufs == nil {
		return nil, errors.New("create QP: out of memory")
	}
	return bufs, nil
}

// QP is the queue pair of a CMID.
type QP struct {
	id    *CMID
	p     *C.struct_ibv_qp
	bufs  *C.struct_rblk_qp_bufs
	chunk int
	send  []WR
	recv  []WR
	// fake is the state of a QP of NewFakeQP, nil for a real one.
	fake *fakeQP
	// Caps are the sizes the device gave.
	Caps QPCaps
}

// Num is the QP number.
func (qp *QP) Num() uint32 { return uint32(C.rblk_qp_num(qp.p)) }

// SendBuf is where a chain of up to len(SendBuf()) send requests is built
// for PostSend. It is C memory; the caller serializes its use.
func (qp *QP) SendBuf() []WR { return qp.send }

// RecvBuf is SendBuf for receives.
func (qp *QP) RecvBuf() []WR { return qp.recv }

// PostSend posts SendBuf()[:n] with one ibv_post_send. On failure it
// returns how many were posted before the one refused.
func (qp *QP) PostSend(n int) (int, error) {
	if e := C.rblk_post_send(qp.p, qp.bufs, C.int(n)); e != 0 {
		return int(qp.bufs.send_posted), errnoErr("ibv_post_send", e)
	}
	return n, nil
}

// PostRecv posts RecvBuf()[:n] with one ibv_post_recv.
func (qp *QP) PostRecv(n int) (int, error) {
	if e := C.rblk_post_recv(qp.p, qp.bufs, C.int(n)); e != 0 {
		return int(qp.bufs.recv_posted), errnoErr("ibv_post_recv", e)
	}
	return n, nil
}

// SetMinRNRTimer sets the RNR NAK timer the QP asks its peer to wait
// (IB encoding: 1 is 0.01 ms, 12 is 0.64 ms, 0 is 655 ms), in RTS.
func (qp *QP) SetMinRNRTimer(v uint8) error {
	if e := C.rblk_set_min_rnr_timer(qp.p, C.uint8_t(v)); e != 0 {
		return errnoErr("ibv_modify_qp min_rnr_timer", e)
	}
	return nil
}

// ToError moves the QP to the error state (ibv_modify_qp IBV_QPS_ERR): the
// device flushes every work request outstanding, and those posted later.
func (qp *QP) ToError() error {
	if qp.fake != nil {
		return qp.fake.toError()
	}
	if e := C.rblk_qp_to_error(qp.p); e != 0 {
		return errnoErr("ibv_modify_qp IBV_QPS_ERR", e)
	}
	return nil
}

// Destroy is rdma_destroy_qp; it frees the posting arrays.
func (qp *QP) Destroy() {
	if qp.bufs == nil {
		return
	}
	if qp.fake != nil {
		qp.fake.destroy()
	} else {
		C.rdma_destroy_qp(qp.id.p)
	}
	C.rblk_free_qp_bufs(qp.bufs)
	qp.bufs, qp.p, qp.send, qp.recv = nil, nil, nil, nil
}

// Context is an ibv_context (owned by librdmacm; never closed here).
type Context struct {
	p *C.struct_ibv_context
}

// DeviceAttr are the limits of a device.
type DeviceAttr struct {
	MaxQPWR         int
	MaxCQE          int
	MaxSGE          int
	MaxQPRdAtom     int
	MaxQPInitRdAtom int
	MaxMRSize       uint64
	// MemWindowType2 says the device has type-2 memory windows
	// (IBV_DEVICE_MEM_WINDOW_TYPE_2A or _2B in device_cap_flags).
	MemWindowType2 bool
	// MaxMW is the most memory windows the device has (max_mw).
	MaxMW int
	// VendorID is vendor_id (0xffffff for Soft-RoCE).
	VendorID uint32
}

// QueryDevice is ibv_query_device.
func (c *Context) QueryDevice() (DeviceAttr, error) {
	var a C.struct_ibv_device_attr
	if e := C.ibv_query_device(c.p, &a); e != 0 {
		return DeviceAttr{}, errnoErr("ibv_query_device", e)
	}
	return DeviceAttr{
		MaxQPWR:         int(a.max_qp_wr),
		MaxCQE:          int(a.max_cqe),
		MaxSGE:          int(a.max_sge),
		MaxQPRdAtom:     int(a.max_qp_rd_atom),
		MaxQPInitRdAtom: int(a.max_qp_init_rd_atom),
		MaxMRSize:       uint64(a.max_mr_size),
		MemWindowType2:  a.device_cap_flags&(C.IBV_DEVICE_MEM_WINDOW_TYPE_2A|C.IBV_DEVICE_MEM_WINDOW_TYPE_2B) != 0,
		MaxMW:           int(a.max_mw),
		VendorID:        uint32(a.vendor_id),
	}, nil
}

// PD is a protection domain.
type PD struct {
	p *C.struct_ibv_pd
}

// AllocPD is ibv_alloc_pd.
func (c *Context) AllocPD() (*PD, error) {
	p, err := C.ibv_alloc_pd(c.p)
	if p == nil {
		return nil, callErr("ibv_alloc_pd", err)
	}
	return &PD{p: p}, nil
}

// Dealloc is ibv_dealloc_pd; every MR and QP on it must be gone.
func (pd *PD) Dealloc() error {
	if pd.p == nil {
		return nil
	}
	e := C.ibv_dealloc_pd(pd.p)
	pd.p = nil
	if e != 0 {
		return errnoErr("ibv_dealloc_pd", e)
	}
	return nil
}

// MR is a registered memory region.
type MR struct {
	p          *C.struct_ibv_mr
	LKey, RKey uint32
}

// RegMR is ibv_reg_mr over [addr, addr+length), which must be memory outside
// the Go heap that stays mapped until Dereg.
func (pd *PD) RegMR(addr unsafe.Pointer, length int, access int) (*MR, error) {
	p, err := C.ibv_reg_mr(pd.p, addr, C.size_t(length), C.int(access))
	if p == nil {
		return nil, callErr("ibv_reg_mr", err)
	}
	return &MR{p: p, LKey: uint32(p.lkey), RKey: uint32(p.rkey)}, nil
}

// Dereg is ibv_dereg_mr. If it fails the MR stays registered (the device
// may still use its keys) and Dereg may be called again.
func (mr *MR) Dereg() error {
	if mr.p == nil {
		return nil
	}
	if e := C.ibv_dereg_mr(mr.p); e != 0 {
		return errnoErr("ibv_dereg_mr", e)
	}
	mr.p = nil
	return nil
}

// MW is a type-2 memory window. RKey is its current key: the one of its
// last bind posted, or the one ibv_alloc_mw gave.
type MW struct {
	p    *C.struct_ibv_mw
	RKey uint32
}

// AllocMW is ibv_alloc_mw(pd, IBV_MW_TYPE_2). A device without memory
// windows fails it with EOPNOTSUPP (or ENOSYS).
func (pd *PD) AllocMW() (*MW, error) {
	p, err := C.rblk_alloc_mw(pd.p)
	if p == nil {
		return nil, callErr("ibv_alloc_mw", err)
	}
	return &MW{p: p, RKey: uint32(p.rkey)}, nil
}

// Dealloc is ibv_dealloc_mw; no work request on the window may be in
// flight. Safe to call twice.
func (mw *MW) Dealloc() error {
	if mw.p == nil {
		return nil
	}
	if e := C.rblk_dealloc_mw(mw.p); e != 0 {
		return errnoErr("ibv_dealloc_mw", e)
	}
	mw.p = nil
	return nil
}

// IncRKey is ibv_inc_rkey: rkey with its 8 low bits (the key a consumer
// chooses) incremented.
func IncRKey(rkey uint32) uint32 { return uint32(C.rblk_inc_rkey(C.uint32_t(rkey))) }

// PostBindMW posts a signaled IBV_WR_BIND_MW with wr_id id, binding mw to
// the QP over [addr, addr+length) of mr with the remote access flags
// access, under rkey (IncRKey(mw.RKey)); mw.RKey is rkey once it is posted.
// It is posted alone, outside SendBuf, and may be called concurrently with
// PostSend (the provider serializes posts).
func (qp *QP) PostBindMW(id uint64, mw *MW, mr *MR, addr, length uint64, access int, rkey uint32) error {
	if e := C.rblk_post_bind_mw(qp.p, C.uint64_t(id), mw.p, mr.p, C.uint64_t(addr), C.uint64_t(length), C.uint(access), C.uint32_t(rkey)); e != 0 {
		return errnoErr("ibv_post_send IBV_WR_BIND_MW", e)
	}
	mw.RKey = rkey
	return nil
}

// PostDrain posts a signaled zero-length RDMA WRITE with wr_id id, alone,
// outside SendBuf: its completion comes after those of everything posted
// before it, flushed if the QP is in the error state.
func (qp *QP) PostDrain(id uint64) error {
	if e := C.rblk_post_drain(qp.p, C.uint64_t(id)); e != 0 {
		return errnoErr("ibv_post_send drain", e)
	}
	return nil
}

// PostLocalInv posts a signaled IBV_WR_LOCAL_INV of rkey with wr_id id.
func (qp *QP) PostLocalInv(id uint64, rkey uint32) error {
	if e := C.rblk_post_local_inv(qp.p, C.uint64_t(id), C.uint32_t(rkey)); e != 0 {
		return errnoErr("ibv_post_send IBV_WR_LOCAL_INV", e)
	}
	return nil
}

// CompChannel is a completion channel whose fd is non-blocking.
type CompChannel struct {
	p *C.struct_ibv_comp_channel
}

// NewCompChannel is ibv_create_comp_channel, made non-blocking.
func (c *Context) NewCompChannel() (*CompChannel, error) {
	p, err := C.ibv_create_comp_channel(c.p)
	if p == nil {
		return nil, callErr("ibv_create_comp_channel", err)
	}
	if err := syscall.SetNonblock(int(p.fd), true); err != nil {
		C.ibv_destroy_comp_channel(p)
		return nil, fmt.Errorf("completion channel: set non-blocking: %w", err)
	}
	return &CompChannel{p: p}, nil
}

// Fd is the channel's fd, readable when a completion event is queued.
func (ch *CompChannel) Fd() int { return int(ch.p.fd) }

// GetEvent consumes one completion event without blocking and reports
// whether there was one. The caller acknowledges it with CQ.AckEvents.
func (ch *CompChannel) GetEvent() (bool, error) {
	r := C.rblk_get_cq_event(ch.p)
	if r < 0 {
		return false, errnoErr("ibv_get_cq_event", -r)
	}
	return r == 1, nil
}

// Destroy is ibv_destroy_comp_channel; its CQs must be destroyed first.
func (ch *CompChannel) Destroy() error {
	if ch.p == nil {
		return nil
	}
	e := C.ibv_destroy_comp_channel(ch.p)
	ch.p = nil
	if e != 0 {
		return errnoErr("ibv_destroy_comp_channel", e)
	}
	return nil
}

// CQ is a completion queue with the buffers Poll fills.
type CQ struct {
	p     *C.struct_ibv_cq
	wc    *C.struct_ibv_wc
	out   *C.struct_rblk_wc
	wcs   []WC
	batch int
}

// NumCompVectors is the device's num_comp_vectors: the completion vectors
// (interrupts) a CQ may be created on, at least 1.
func (c *Context) NumCompVectors() int { return max(1, int(C.rblk_num_comp_vectors(c.p))) }

// NewCQ is ibv_create_cq with cqe entries on channel ch, on completion
// vector vector (below NumCompVectors). Poll returns up to batch
// completions per call.
func (c *Context) NewCQ(cqe int, ch *CompChannel, batch, vector int) (*CQ, error) {
	wc := (*C.struct_ibv_wc)(C.calloc(C.size_t(batch), C.sizeof_struct_ibv_wc))
	out := (*C.struct_rblk_wc)(C.calloc(C.size_t(batch), C.sizeof_struct_rblk_wc))
	if wc == nil || out == nil {
		C.free(unsafe.Pointer(wc))
		C.free(unsafe.Pointer(out))
		return nil, errors.New("create CQ: out of memory")
	}
	p, err := C.ibv_create_cq(c.p, C.int(cqe), nil, ch.p, C.int(vector))
	if p == nil {
		C.free(unsafe.Pointer(wc))
		C.free(unsafe.Pointer(out))
		return nil, callErr("ibv_create_cq", err)
	}
	return &CQ{p: p, wc: wc, out: out, wcs: unsafe.Slice((*WC)(unsafe.Pointer(out)), batch), batch: batch}, nil
}

// Poll polls up to max completions (at most the batch) into WCs(). With
// arm set, when there is none it arms the CQ for the next completion and
// polls once more.
func (cq *CQ) Poll(max int, arm bool) (int, error) {
	max = min(max, cq.batch)
	a := C.int(0)
	if arm {
		a = 1
	}
	r := C.rblk_poll(cq.p, cq.wc, cq.out, C.int(max), a)
	if r < 0 {
		return 0, errnoErr("ibv_poll_cq", -r)
	}
	return int(r), nil
}

// PollSpin polls in C until completions come or budget passes.
func (cq *CQ) PollSpin(max int, budget time.Duration) (int, error) {
	max = min(max, cq.batch)
	r := C.rblk_poll_spin(cq.p, cq.wc, cq.out, C.int(max), C.int64_t(budget.Nanoseconds()))
	if r < 0 {
		return 0, errnoErr("ibv_poll_cq", -r)
	}
	return int(r), nil
}

// WCs is the buffer Poll fills (C memory).
func (cq *CQ) WCs() []WC { return cq.wcs }

// AckEvents is ibv_ack_cq_events.
func (cq *CQ) AckEvents(n int) {
	if n > 0 {
		C.ibv_ack_cq_events(cq.p, C.uint(n))
	}
}

// Destroy is ibv_destroy_cq; every event must be acknowledged and the QPs
// using it destroyed.
func (cq *CQ) Destroy() error {
	if cq.p == nil {
		return nil
	}
	e := C.ibv_destroy_cq(cq.p)
	C.free(unsafe.Pointer(cq.wc))
	C.free(unsafe.Pointer(cq.out))
	cq.p, cq.wc, cq.out, cq.wcs = nil, nil, nil, nil
	if e != 0 {
		return errnoErr("ibv_destroy_cq", e)
	}
	return nil
}
