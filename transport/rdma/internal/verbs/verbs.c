//go:build linux && cgo && rdma

// verbs.c: the C side of package verbs (see verbs.h).

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>

#include "verbs.h"

void rblk_free_qp_bufs(struct rblk_qp_bufs *b) {
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

struct rblk_qp_bufs *rblk_alloc_qp_bufs(int chunk) {
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
int rblk_post_send(struct ibv_qp *qp, struct rblk_qp_bufs *b, int n) {
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
int rblk_post_recv(struct ibv_qp *qp, struct rblk_qp_bufs *b, int n) {
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
int rblk_poll(struct ibv_cq *cq, struct ibv_wc *wc, struct rblk_wc *out, int n, int arm) {
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
int rblk_poll_spin(struct ibv_cq *cq, struct ibv_wc *wc, struct rblk_wc *out, int n, int64_t budget_ns) {
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
int rblk_get_cq_event(struct ibv_comp_channel *ch) {
	struct ibv_cq *cq;
	void *ctx;

	if (ibv_get_cq_event(ch, &cq, &ctx))
		return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
	return 1;
}


int rblk_get_event(struct rdma_event_channel *ch, struct rblk_event *out) {
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

void rblk_sockaddr(struct sockaddr_storage *ss, int v6, const uint8_t *ip, uint16_t port) {
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

int rblk_local_addr(struct rdma_cm_id *id, uint8_t *ip, uint16_t *port) {
	return rblk_addr(rdma_get_local_addr(id), ip, port);
}

int rblk_peer_addr(struct rdma_cm_id *id, uint8_t *ip, uint16_t *port) {
	return rblk_addr(rdma_get_peer_addr(id), ip, port);
}

const char *rblk_device_name(struct rdma_cm_id *id) {
	if (!id->verbs || !id->verbs->device)
		return "";
	return ibv_get_device_name(id->verbs->device);
}

void rblk_sgid(struct rdma_cm_id *id, uint8_t *gid) {
	memcpy(gid, id->route.addr.addr.ibaddr.sgid.raw, 16);
}

int rblk_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq,
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

int rblk_connect(struct rdma_cm_id *id, int accept, const void *pd, uint8_t pdlen,
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

int rblk_set_min_rnr_timer(struct ibv_qp *qp, uint8_t timer) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.min_rnr_timer = timer;
	return ibv_modify_qp(qp, &attr, IBV_QP_MIN_RNR_TIMER);
}

int rblk_qp_to_error(struct ibv_qp *qp) {
	struct ibv_qp_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &attr, IBV_QP_STATE);
}

// rblk_alloc_mw is ibv_alloc_mw of a type-2 window; NULL with errno set.
struct ibv_mw *rblk_alloc_mw(struct ibv_pd *pd) {
	return ibv_alloc_mw(pd, IBV_MW_TYPE_2);
}

int rblk_dealloc_mw(struct ibv_mw *mw) { return ibv_dealloc_mw(mw); }

// rblk_post_bind_mw posts one signaled IBV_WR_BIND_MW of the type-2 window
// mw over [addr, addr+length) of mr, under the new rkey (whose 8 low bits
// the caller chose with ibv_inc_rkey). Once posted, mw->rkey is the new
// one: the next bind names the window by it (rxe checks that it is the
// window's current key).
int rblk_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, struct ibv_mr *mr,
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
int rblk_post_local_inv(struct ibv_qp *qp, uint64_t wr_id, uint32_t rkey) {
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
int rblk_post_drain(struct ibv_qp *qp, uint64_t wr_id) {
	struct ibv_send_wr wr, *bad = NULL;

	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.opcode = IBV_WR_RDMA_WRITE;
	wr.send_flags = IBV_SEND_SIGNALED;
	return ibv_post_send(qp, &wr, &bad);
}

uint32_t rblk_inc_rkey(uint32_t rkey) { return ibv_inc_rkey(rkey); }
int rblk_num_comp_vectors(struct ibv_context *c) { return c->num_comp_vectors; }

struct ibv_context *rblk_id_verbs(struct rdma_cm_id *id) { return id->verbs; }
struct ibv_qp *rblk_id_qp(struct rdma_cm_id *id) { return id->qp; }
uint8_t rblk_id_port(struct rdma_cm_id *id) { return id->port_num; }
uint32_t rblk_qp_num(struct ibv_qp *qp) { return qp->qp_num; }
