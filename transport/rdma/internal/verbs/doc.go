// Package verbs is the thin cgo layer of transport/rdma over libibverbs and
// librdmacm (rdma-core). All of the provider's C lives in verbs.go, which is
// only built with the tag rdma (on linux, with cgo); without it this package
// is empty.
//
// The hot paths cost one cgo call each: posting a chain of work requests
// (the caller fills WR records in C memory owned by the QP, the C side turns
// them into ibv_send_wr/ibv_recv_wr records preallocated with the QP and
// calls ibv_post_send or ibv_post_recv once), polling the CQ (ibv_poll_cq,
// optionally ibv_req_notify_cq and a second poll in the same call), and
// consuming a completion event.
//
// No Go pointer is handed to C beyond the duration of a call: memory
// registered with RegMR must be outside the Go heap.
package verbs
