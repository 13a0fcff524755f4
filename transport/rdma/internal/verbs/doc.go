// Package verbs is the thin layer of transport/rdma over libibverbs and
// librdmacm (rdma-core).
//
// device.go, pure Go and in every build, is the provider's view of the
// device: small interfaces (Stack, EventChannel, CMID, Context, PD, MR, MW,
// QP, CompChannel, CQ), the records work requests and completions cross in
// (WR, WC), and the constants of the rdma-core ABI. transport/rdma is
// written against them only, so its ring, completion and connection logic
// builds and is tested without cgo, over a device in Go that lives in its
// tests.
//
// verbs.go with verbs.c and verbs.h implement them over the libraries
// (Open); they are built only with the tag rdma, on linux with cgo, and
// check at compile time that the constants and the record layouts are
// the headers'. Without the tag this package is device.go alone.
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
//
// fake.go, built only with the tags rdma and rdmacfake (never into a
// program), is a QP whose ibv_post_send and ibv_post_recv are C functions
// of the test, for the tests of the C posting functions:
//
//	go test -tags rdma,rdmacfake ./transport/rdma/internal/verbs/
package verbs
