// Package rdma is the transport provider over libibverbs and librdmacm
// (rdma-core): InfiniBand, RoCE and Soft-RoCE (rxe).
//
// # Builds
//
// The verbs provider needs cgo and the rdma-core headers, so it is opt-in:
// build with -tags rdma (on linux, with libibverbs-dev and librdmacm-dev
// installed). Every cgo call lives in the internal package verbs. Without
// the tag, New fails with an error wrapping transport.ErrUnsupported that
// says so; Devices, DeviceAddrs and the constants work in both builds.
// Without any device New fails with transport.ErrNoDevice and what to do.
//
// # Connections
//
// Listen binds an RDMA CM id (rdma_bind_addr, rdma_listen) to an IP address
// of an RDMA device's network interface (see DeviceAddrs); Accept delivers
// each RDMA_CM_EVENT_CONNECT_REQUEST as a transport.ConnRequest, whose id
// is moved at once to an event channel of its own (rdma_migrate_id), so
// that connections outlive their listener. ConnRequest.Prepare creates the
// connection's resources, the QP on the request's id (rdma_create_qp, which
// leaves it in INIT, where receives may be posted), before anything is
// accepted; ConnRequest.Accept creates them if Prepare did not, calls
// rdma_accept and waits for ESTABLISHED; Reject is rdma_reject. Dial is rdma_resolve_addr, rdma_resolve_route,
// rdma_connect and ESTABLISHED (REJECTED by the peer's application gives a
// *transport.RejectError with its private data; a port nobody listens on,
// an unreachable address and the like give errors that name the address).
// Contexts are honoured throughout. The RNR retry count is 7 (infinite) and
// each side asks its peer for an RNR NAK timer of 0.64 ms (set with an
// RTS-to-RTS modify, the RDMA CM leaving 655 ms), so a SEND that comes
// before its RECV is retried rather than failed.
//
// RDMA_CM_EVENT_DEVICE_REMOVAL fails the listener's Accept, from then on,
// with an error matching transport.ErrDeviceRemoved (not ErrClosed); on a
// connection it completes every outstanding work request as flushed (the
// device will not), makes Poll end with ErrDeviceRemoved and releases the
// verbs resources, which the kernel waits for to finish the removal.
//
// Private data: at most MaxConnectPrivateData (56) bytes with Dial,
// MaxAcceptPrivateData (196) with Accept and MaxRejectPrivateData (147) with
// Reject. A peer of the IB CM receives the whole, zero-padded field, so the
// length travels with the data: one length byte first, or, for data that
// fills the field of a connect or an accept, the flow-control bit of the
// connection parameters set and no length byte. Both ends must be this
// provider.
//
// Each connection has its own protection domain (ibv_alloc_pd): a region
// registered on one can not be reached through another, its own completion
// queue on its own completion channel (the CQs of successive connections
// take the device's completion vectors, num_comp_vectors, round robin,
// rather than all vector 0), one RC QP (selective signaling, one SGE each,
// 64 bytes of inline data when the device has it), and its own RDMA CM
// event channel. Register is ibv_reg_mr with the mapped
// access flags; the memory must come from transport.AllocMemory (outside
// the Go heap): the device keeps its address, which the cgo rules forbid
// for Go memory, and Register refuses Go heap memory, and file mappings
// (transport.ErrFileMapping). When the memlock limit is too low, the
// error says how to raise it. Huge pages of AllocMemory(n, true) register
// as well: hugetlb pages, and transparent huge pages, which registration
// pins without splitting them (both checked on rxe, with RDMA WRITE and
// READ across a 2 MiB boundary).
//
// # Memory windows
//
// A conn is a transport.WindowBinder when its device has type-2 memory
// windows (IBV_DEVICE_MEM_WINDOW_TYPE_2A or _2B): memory registered once
// with transport.AccessBindWindow (IBV_ACCESS_MW_BIND) is granted span by
// span with BindWindow, a type-2 MW (ibv_alloc_mw, pooled per conn) bound
// to the conn's QP by a signaled IBV_WR_BIND_MW under a new key
// (ibv_inc_rkey), and revoked by Invalidate, an IBV_WR_LOCAL_INV. Those
// requests have send-queue room of their own (8 slots beyond
// SendQueueDepth, and as many CQ entries, besides the drain request's), and their completions are
// taken inside Poll (their wr_ids are marked) and never returned. The key
// of a window is 8 bits a consumer chooses over the MW's index, so a key
// comes back after 256 binds of the same MW: a peer must not keep keys of
// revoked grants. Without type-2 windows BindWindow fails with
// transport.ErrUnsupported and the caller registers per grant instead.
//
// # Completions
//
// No OS thread sleeps in C. The fds of the completion channel and of the RDMA
// CM event channel are non-blocking and waited on through Go's network
// poller (a duplicate of each registered with os.NewFile; SyscallConn's
// Read with a function that returns false on EAGAIN). Poll polls up to 64
// completions with one ibv_poll_cq and keeps those that do not fit the
// caller's slice for the next call; when the CQ is empty it arms it
// (ibv_req_notify_cq) and polls again in the same cgo call, then sleeps
// until the channel is readable, takes the event (ibv_get_cq_event) and
// acknowledges events 32 at a time. A sleep allocates nothing: what ends
// it when its context ends (a context.AfterFunc) stays registered from
// one sleep to the next with the same context, so Poll, PostSend and
// PostRecv make no heap allocation per work request. With Options.BusyPoll (or
// RBLK_RDMA_BUSY_POLL=1) it first spins on ibv_poll_cq, in C, for that long.
// One goroutine per connection sleeps on the RDMA CM channel for
// DISCONNECTED, which breaks the connection.
//
// PostSend fills work request records in C memory preallocated with the QP
// (under the send queue's lock, no allocation) and posts a chain of up to
// 256 with one ibv_post_send; PostRecv likewise (a batch of receive
// reposts is one linked list of ibv_recv_wr and one ibv_post_recv). A queue's depth counts
// what is posted and not yet returned by Poll (ErrQueueFull beyond it), so
// neither the QP nor the CQ can overflow. Completions are returned in
// posting order per queue; once the connection is broken, the flushed
// receives come after the send queue's completions.
//
// # Selective signaling
//
// The QP is created with sq_sig_all = 0, and a work request goes with
// IBV_SEND_SIGNALED unless it is transport.WorkRequest.Unsignaled (bind
// and invalidate requests of memory windows always are signaled). Send
// completions come in order, so the completion of a later request covers
// the unsignaled ones before it: a success or a failure means they
// succeeded (a failed one would have been reported first: the IBA has a
// device report every request that completes in error, signaled or not),
// and so does a flush on a device that also reports flushed unsignaled
// requests, as the IBA requires: rxe does (checked on 6.1 and 6.12: the
// completer posts a completion for every flushed request, signaled or
// not), and so does mlx5 (the kernel's own storage and NFS clients rely on
// it). On other devices the unsignaled requests a flush covers are
// reported flushed, as nothing says whether they executed. Poll returns
// what failed or was flushed, never the success of an unsignaled request.
// An unsignaled request takes room in SendQueueDepth until it is covered
// and Poll got past it; a run of SendQueueDepth of them would never be, so
// the request that would make one is posted signaled (its success is not
// returned either).
//
// Requests that succeeded without a completion leave nothing to cover them
// when the connection breaks after them: a broken connection posts, when
// the last request it posted is unsignaled, one drain request (a signaled
// zero-length RDMA WRITE, which checks no key, with room of its own beyond
// SendQueueDepth) after everything else; its completion, flushed on a QP
// in the error state, covers what is left, so that Poll ends with ErrClosed
// and Close need not wait for flushTimeout. The same goes for a request
// refused at post time behind unsignaled ones, whose turn would otherwise
// never come: there the QP still works, and the drain request executes.
//
// Local checks are done at post time, as the software provider does: an SGE
// outside a live region of the connection, or a READ or RECV into a region
// without local write access, completes with StatusLocalProtectionError in
// its turn (after the requests before it) and breaks the connection, and
// the requests after it are flushed. ibv_wc statuses map to
// transport.Status (a receive's IBV_WC_LOC_QP_OP_ERR, which is how
// Soft-RoCE reports a SEND longer than the buffer, is a local length
// error); others are StatusTransportError. VendorErr of a failed completion
// carries the ibv_wc_status in its top 8 bits and the device's vendor_err
// below (VendorErrString explains it), and the first failure is logged at
// warn level with ibv_wc_status_str, and ends the error Poll returns last.
//
// A failure breaks the connection with rdma_disconnect: the QP enters the
// error state and flushes everything outstanding, and the peer gets
// DISCONNECTED and breaks too. Close disconnects, collects the flush
// completions (Poll returns them afterwards, then transport.ErrClosed),
// destroys the QP, after which the device touches no buffer, then the CQ,
// the completion channel, the regions, the PD, the id and its channel, and
// waits for its goroutine. Close is safe to call twice, and concurrently:
// each call returns once the conn is destroyed. A CQ that fails to poll
// (ibv_poll_cq errors) closes the conn the same way, in the background:
// nothing is reported while the QP lives, then everything outstanding
// completes flushed and Poll ends with an ErrClosed that says why.
//
// # Connection state
//
// A connection has one state (state.go), which only moves forward, each
// move made once by one transition function under one lock: connecting
// (Prepare: receives, no sends), established (ESTABLISHED came; the CM
// goroutine runs), failing (a request was refused at post time: nothing
// more is posted, the QP works on until that request's turn), draining
// (broken: the QP is in the error state and flushes), closed (Close began,
// or the device went, or the CQ failed: the one that moved it there runs
// the close) and destroyed (the verbs resources are gone). Leaving
// connecting, established or failing stops the QP once (rdma_disconnect,
// or a move to the error state for a conn never established). A bind or
// invalidation of a memory window is ended exactly once, by whichever of
// its completion, the refusal of its post, the device's removal or the
// teardown comes first; the others leave it alone.
//
// DeviceInfo, on a Conn or a Listener (type-assert to
// interface{ DeviceInfo() string }), names the device, port and source GID
// in use and the local address, "rxe0 port 1 gid ::ffff:192.0.2.1
// 192.0.2.1:7480", for logs.
//
// # Failpoints
//
// Built with the tags rdma and failpoints, the provider injects faults
// into the device interfaces when FailpointsEnv (RBLK_RDMA_FAILPOINTS)
// names some: QP and CQ creation, memory-window allocation and bind,
// post send and receive (a random prefix posted), a send completion
// turned into RETRY_EXC_ERR, connect and accept errors, REJECTED instead
// of ESTABLISHED on an accepting side and a real rdma_disconnect in the
// middle of IO, each with a probability N/M (syntax on FailpointsEnv),
// from a seeded PRNG. Each injection is logged at warn level and counted
// (FailpointCounts); every fault is one the device can produce, delivered
// as the device delivers it. Without the tag the variable is ignored,
// with a warning. The same injection code runs in the default tests over
// the fake device.
//
// # Tests
//
// The provider is written against the small device interfaces of the
// internal package verbs, which the cgo layer implements over rdma-core;
// its tests implement them with a device in Go (fake_test.go: an RDMA CM
// and RC queue pairs that execute SEND, RECV, RDMA WRITE and READ and
// memory-window binds on registered memory, counting every object made
// and destroyed). So the default go test, without cgo or a device, runs
// transporttest.RunProvider and the provider's own tests of its rings,
// selective signaling, windows and error paths over that device.
//
// With -tags rdma the tests also run transporttest.RunProvider over real
// connections when a device exists (listening on RBLK_RDMA_ADDR, or the
// first IPv4 address of the first device's network interface), and skip
// those otherwise. On machines without RDMA hardware, run them in the
// Soft-RoCE VM:
//
//	go test -c -tags rdma -o DIR/rdma.test ./transport/rdma/
//	go test -c -race -tags rdma -o DIR/rdma-race.test ./transport/rdma/
//	vm/run.sh transport/rdma/testdata/guest-test.sh DIR
package rdma
