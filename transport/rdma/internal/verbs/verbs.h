//go:build linux && cgo && rdma

// verbs.h: the C side of package verbs, over libibverbs and librdmacm.
// Work requests and completions cross to Go as the records below, in C
// memory preallocated with the QP and the CQ.

#ifndef RBLK_VERBS_H
#define RBLK_VERBS_H

#include <stddef.h>
#include <stdint.h>
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

void rblk_free_qp_bufs(struct rblk_qp_bufs *b);
struct rblk_qp_bufs *rblk_alloc_qp_bufs(int chunk);
int rblk_post_send(struct ibv_qp *qp, struct rblk_qp_bufs *b, int n);
int rblk_post_recv(struct ibv_qp *qp, struct rblk_qp_bufs *b, int n);
int rblk_poll(struct ibv_cq *cq, struct ibv_wc *wc, struct rblk_wc *out, int n, int arm);
int rblk_poll_spin(struct ibv_cq *cq, struct ibv_wc *wc, struct rblk_wc *out, int n, int64_t budget_ns);
int rblk_get_cq_event(struct ibv_comp_channel *ch);
int rblk_get_event(struct rdma_event_channel *ch, struct rblk_event *out);
void rblk_sockaddr(struct sockaddr_storage *ss, int v6, const uint8_t *ip, uint16_t port);
int rblk_local_addr(struct rdma_cm_id *id, uint8_t *ip, uint16_t *port);
int rblk_peer_addr(struct rdma_cm_id *id, uint8_t *ip, uint16_t *port);
const char *rblk_device_name(struct rdma_cm_id *id);
void rblk_sgid(struct rdma_cm_id *id, uint8_t *gid);
int rblk_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *cq,
			  uint32_t send_wr, uint32_t recv_wr, uint32_t inline_data, struct ibv_qp_cap *cap);
int rblk_connect(struct rdma_cm_id *id, int accept, const void *pd, uint8_t pdlen,
			uint8_t resp_res, uint8_t init_depth, uint8_t flow_control, uint8_t retry, uint8_t rnr_retry);
int rblk_set_min_rnr_timer(struct ibv_qp *qp, uint8_t timer);
int rblk_qp_to_error(struct ibv_qp *qp);
struct ibv_mw *rblk_alloc_mw(struct ibv_pd *pd);
int rblk_dealloc_mw(struct ibv_mw *mw);
int rblk_post_bind_mw(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw, struct ibv_mr *mr,
			     uint64_t addr, uint64_t length, unsigned int access, uint32_t rkey);
int rblk_post_local_inv(struct ibv_qp *qp, uint64_t wr_id, uint32_t rkey);
int rblk_post_drain(struct ibv_qp *qp, uint64_t wr_id);
uint32_t rblk_inc_rkey(uint32_t rkey);
int rblk_num_comp_vectors(struct ibv_context *c);
struct ibv_context *rblk_id_verbs(struct rdma_cm_id *id);
struct ibv_qp *rblk_id_qp(struct rdma_cm_id *id);
uint8_t rblk_id_port(struct rdma_cm_id *id);
uint32_t rblk_qp_num(struct ibv_qp *qp);

#endif
