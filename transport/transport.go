package transport

import (
	"context"
	"errors"
	"fmt"
)

// Access is a set of access rights of a memory region, as in ibv_access_flags.
type Access uint32

const (
	// AccessLocalWrite lets local operations (RECV, the destination of an
	// RDMA READ) write into the region.
	AccessLocalWrite Access = 1 << iota
	// AccessRemoteRead lets the peer RDMA READ from the region.
	AccessRemoteRead
	// AccessRemoteWrite lets the peer RDMA WRITE into the region.
	// As with verbs, it requires AccessLocalWrite.
	AccessRemoteWrite
	// AccessBindWindow lets memory windows be bound to the region
	// (IBV_ACCESS_MW_BIND): see WindowBinder.
	AccessBindWindow
)

func (a Access) String() string {
	s := ""
	for _, f := range []struct {
		bit  Access
		name string
	}{{AccessLocalWrite, "local-write"}, {AccessRemoteRead, "remote-read"}, {AccessRemoteWrite, "remote-write"}, {AccessBindWindow, "bind-window"}} {
		if a&f.bit != 0 {
			if s != "" {
				s += "|"
			}
			s += f.name
		}
	}
	if s == "" {
		return "none"
	}
	return s
}

// Region is a memory region registered with one Conn (one protection domain).
// It stays valid until Deregister or until its Conn is closed.
type Region interface {
	// Bytes is the local view of the registered memory. The caller owns its
	// contents, but must not touch bytes that an operation in flight reads or
	// writes (the buffer of a posted SEND, RECV, READ or WRITE) until that
	// operation's completion has been polled.
	Bytes() []byte
	// Addr is the address under which the peer names this region in one-sided
	// operations. Offsets within the region are added to it.
	Addr() uint64
	// LKey names the region in local work requests.
	LKey() uint32
	// RKey names the region in the peer's one-sided operations. It is only
	// meaningful if the region has remote access rights.
	RKey() uint32
	// Access is the set of rights the region was registered with.
	Access() Access
	// Deregister revokes the region: after it returns, the peer's operations
	// that name its rkey fail with StatusRemoteAccessError and break the
	// connection, and its lkey may no longer be used in new work requests.
	// The memory itself is not freed. Operations already posted that use the
	// region must have completed first; Deregister is safe to call twice.
	//
	// If it fails, the error matches ErrDeregisterFailed and the region may
	// still be registered: the peer may still reach the memory with the
	// rkey. The caller must then not reuse the memory for other data, nor
	// free it, until a later Deregister succeeds or the Conn is closed;
	// the provider keeps the region and refuses to Register memory that
	// overlaps it on the same Conn.
	Deregister() error
}

// WindowBinder is implemented by a Conn that can give its peer access to a
// span of a registered region through a memory window bound to this
// connection (a type-2 memory window bound to its queue pair), as the
// kernel's storage targets do: the memory is registered once, and access
// is granted and revoked per span without a registration on the IO path.
//
// A Conn that does not implement it, or whose BindWindow fails with
// ErrUnsupported, needs a Register per span instead.
type WindowBinder interface {
	// BindWindow gives the peer access to r.Bytes()[off:off+length] with
	// access, a non-empty subset of AccessRemoteRead|AccessRemoteWrite. r
	// must be a live region of this Conn registered with AccessBindWindow,
	// and with AccessLocalWrite for AccessRemoteWrite, else the error says
	// why. The window's rkey works only through this Conn: the peer's
	// operations through another connection, or after Invalidate, Close or
	// the break of this one, fail with StatusRemoteAccessError.
	//
	// It returns once the bind has completed. On verbs the bind is a
	// send-queue work request whose completion only Poll reaps (and never
	// returns), so another goroutine must be polling the Conn; the bind
	// and invalidate requests have send-queue room of their own and take
	// none of SendQueueDepth. It fails with ErrUnsupported when the device
	// has no type-2 memory windows, with ErrClosed on a broken connection
	// and with ctx.Err() when ctx ends first. In that last case no window
	// is handed out and its rkey was never returned, but the bind may
	// still be in flight: the provider invalidates the window as soon as
	// the bind completes (or the connection closes) and keeps its memory
	// window out of reuse until then.
	//
	// A failed bind or invalidate request breaks the connection, like any
	// failed work request: BindWindow checks what it can before posting.
	BindWindow(ctx context.Context, r Region, off, length int, access Access) (Window, error)
}

// WindowSpanChecker is implemented by a WindowBinder that tells whether its
// device holds the peer's operations through a window to the window's
// span.
type WindowSpanChecker interface {
	// WindowSpanChecked is false when the device checks the peer's
	// operations through a window against the window's region only
	// (Soft-RoCE, rxe, does): the window's rkey then reaches its whole
	// region, within the window's rights and until it is invalidated. A
	// caller that must confine a peer to the span binds windows over
	// regions that hold no more than that (a region per chunk, registered
	// once).
	WindowSpanChecked() bool
}

// Window is a span of a registered region that the peer may reach through
// one connection until it is invalidated.
type Window interface {
	// Addr is the address under which the peer names the window's first
	// byte in one-sided operations.
	Addr() uint64
	// RKey names the window in the peer's one-sided operations.
	RKey() uint32
	// Access is the set of remote rights the window was bound with.
	Access() Access
	// Invalidate revokes the window: once it returns nil, the peer's
	// operations that name its rkey fail with StatusRemoteAccessError (and
	// break the connection), and none of its operations through the
	// window still reads or writes the memory. Operations already
	// executed are not undone.
	//
	// On a broken or closed connection the window died with it and
	// Invalidate returns nil: a type-2 window is reachable only through
	// its queue pair, and a queue pair in the error state executes
	// nothing more (it never leaves that state; it is only destroyed).
	//
	// If it fails, the error matches ErrDeregisterFailed and the peer may
	// still reach the memory: the caller must not reuse it for other data
	// until a later Invalidate succeeds or the Conn is closed. That is
	// the case when ctx ends before the invalidation completed on verbs
	// (the error then also matches ctx.Err()); the software provider
	// instead breaks the connection to end a peer's request stalled on
	// the window, and returns nil. Safe to call twice; like BindWindow it
	// needs the Conn to be polled.
	//
	// Deregistering the window's region, or closing the Conn, kills the
	// window as well.
	Invalidate(ctx context.Context) error
}

// Opcode is the kind of a work request or completion.
type Opcode uint8

const (
	// OpSend is a two-sided SEND; the peer must have a RECV posted.
	OpSend Opcode = iota + 1
	// OpWrite is a one-sided RDMA WRITE from local memory into the peer's region.
	OpWrite
	// OpWriteImm is an RDMA WRITE WITH IMMEDIATE: like OpWrite, and it
	// consumes a RECV at the peer, which completes with OpRecvWriteImm.
	OpWriteImm
	// OpRead is a one-sided RDMA READ from the peer's region into local memory.
	OpRead
	// OpRecv is the completion of a posted receive that got a SEND.
	OpRecv
	// OpRecvWriteImm is the completion of a posted receive consumed by the
	// peer's OpWriteImm; ByteLen is the length of the WRITE and Imm its data.
	OpRecvWriteImm
)

var opNames = [...]string{"invalid", "SEND", "RDMA_WRITE", "RDMA_WRITE_WITH_IMM", "RDMA_READ", "RECV", "RECV_RDMA_WITH_IMM"}

func (o Opcode) String() string {
	if int(o) < len(opNames) {
		return opNames[o]
	}
	return fmt.Sprintf("opcode(%d)", uint8(o))
}

// Status is the completion status of a work request, as ibv_wc_status.
type Status uint8

const (
	// StatusSuccess: the operation completed.
	StatusSuccess Status = iota
	// StatusLocalLengthError: a SEND was larger than the RECV buffer it met.
	StatusLocalLengthError
	// StatusLocalProtectionError: a local buffer is not covered by the lkey
	// given, or lacks local write access.
	StatusLocalProtectionError
	// StatusRemoteAccessError: the peer refused a one-sided operation: an
	// unknown or deregistered rkey, out of bounds, or missing rights.
	StatusRemoteAccessError
	// StatusRemoteInvalidRequest: the peer could not parse the request.
	StatusRemoteInvalidRequest
	// StatusRNRRetryExceeded: the peer had no RECV posted for too long.
	StatusRNRRetryExceeded
	// StatusFlushed: the connection broke or closed before the work request
	// was executed (IBV_WC_WR_FLUSH_ERR).
	StatusFlushed
	// StatusTransportError: the connection failed (retry exceeded, reset).
	StatusTransportError
)

var statusNames = [...]string{
	"success", "local length error", "local protection error", "remote access error",
	"remote invalid request error", "RNR retry counter exceeded", "work request flushed error",
	"transport retry counter exceeded",
}

func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("status(%d)", uint8(s))
}

// Completion reports the end of one work request.
type Completion struct {
	// ID is the caller's WorkRequest.ID, or RecvRequest.ID for receives.
	ID uint64
	// Op says what completed.
	Op Opcode
	// Status is StatusSuccess or why the request failed. Every failure but
	// StatusFlushed also breaks the connection: later requests complete with
	// StatusFlushed.
	Status Status
	// ByteLen is the number of bytes received (OpRecv, OpRecvWriteImm).
	ByteLen int
	// Imm is the immediate data of OpRecvWriteImm.
	Imm uint32
	// VendorErr carries a provider-specific detail of a failure, or 0.
	VendorErr uint32
}

// Err returns nil for a successful completion and a *CompletionError otherwise.
func (c Completion) Err() error {
	if c.Status == StatusSuccess {
		return nil
	}
	return &CompletionError{Op: c.Op, Status: c.Status}
}

// CompletionError is a failed completion as an error. It matches
// ErrRemoteAccess with errors.Is when its status is StatusRemoteAccessError,
// and ErrClosed when it was flushed.
type CompletionError struct {
	Op     Opcode
	Status Status
}

func (e *CompletionError) Error() string { return fmt.Sprintf("%v: %v", e.Op, e.Status) }

// Is makes errors.Is(err, ErrRemoteAccess) and errors.Is(err, ErrClosed) work.
func (e *CompletionError) Is(target error) bool {
	switch target {
	case ErrRemoteAccess:
		return e.Status == StatusRemoteAccessError
	case ErrClosed:
		return e.Status == StatusFlushed
	}
	return false
}

// SGE is a scatter/gather element: a span of a registered local region.
type SGE struct {
	// Region is the registered local region; Offset and Length select a span of it.
	Region Region
	Offset int
	Length int
}

// Bytes returns the span the SGE names.
func (s SGE) Bytes() []byte { return s.Region.Bytes()[s.Offset : s.Offset+s.Length] }

// WorkRequest is a send-queue work request.
type WorkRequest struct {
	// ID is returned in the Completion.
	ID uint64
	// Op is OpSend, OpWrite, OpWriteImm or OpRead.
	Op Opcode
	// Local is the local buffer: the source of SEND and WRITE, the
	// destination of READ (which needs AccessLocalWrite).
	Local SGE
	// RemoteAddr and RKey name the peer's memory for OpWrite, OpWriteImm and OpRead.
	RemoteAddr uint64
	RKey       uint32
	// Imm is the immediate data of OpWriteImm.
	Imm uint32
	// Unsignaled asks for no completion when the request succeeds, as a
	// work request without IBV_SEND_SIGNALED on a queue pair created with
	// sq_sig_all = 0 (selective signaling). Send-queue completions come in
	// order, so the successful completion of a later signaled request of
	// the same Conn implies this one's success, and only then is its
	// send-queue entry free again: of every SendQueueDepth requests in a
	// row, the caller must signal at least the last. A request that does
	// not succeed (its own failure, or StatusFlushed after the connection
	// broke) completes with its status all the same, so that after a
	// failure every unsignaled request that did not succeed is reported;
	// those that succeeded before the failure are not.
	Unsignaled bool
}

// RecvRequest posts a receive buffer, which needs AccessLocalWrite.
type RecvRequest struct {
	ID    uint64
	Local SGE
}

// Conn is one reliable connection (an RC queue pair with its own protection
// domain and completion queue). Its semantics are those of RC verbs:
//   - Work requests posted on one Conn execute in order. In particular a SEND
//     (or WRITE WITH IMMEDIATE) posted after an RDMA WRITE is delivered to the
//     peer only after that WRITE's data is placed in the peer's memory.
//   - A SEND consumes the oldest RECV the peer has posted.
//   - The first failed work request breaks the connection: every request
//     after it, and every posted RECV, completes with StatusFlushed.
//
// Post methods, Poll and Register may be called from several goroutines.
// Poll should be called from one goroutine at a time.
type Conn interface {
	// PeerPrivateData is the private data the peer gave at connect or accept.
	PeerPrivateData() []byte

	// Register registers buf, which the caller owns and which must stay
	// allocated until the region is deregistered. Providers that hand memory
	// to hardware require buf to come from AllocMemory (outside the Go heap).
	// A region of one Conn cannot be used through another Conn. Memory
	// that is a mapping of a file is refused with an error matching
	// ErrFileMapping (see CheckNotFileMapping).
	Register(buf []byte, access Access) (Region, error)

	// PostSend queues work requests in order. It does not wait for them:
	// their buffers belong to the provider until their completions are polled.
	// It fails with ErrQueueFull if more than SendQueueDepth requests would
	// be outstanding, and with ErrClosed after Close or a broken connection.
	PostSend(wrs ...WorkRequest) error

	// PostRecv queues receive buffers. They belong to the provider until
	// their completions are polled.
	PostRecv(rrs ...RecvRequest) error

	// Poll waits until at least one completion is available, then copies up
	// to len(out) of them into out and returns their count. It returns
	// ctx.Err() when ctx ends first, and ErrClosed once the connection is
	// closed or broken and every completion (the flushed ones included) has
	// been returned.
	Poll(ctx context.Context, out []Completion) (int, error)

	// Limits reports the queue sizes and message limits of the connection.
	Limits() Limits

	// LocalAddr and RemoteAddr describe the endpoints for logs.
	LocalAddr() string
	RemoteAddr() string

	// Close breaks the connection and releases its regions. Work requests in
	// flight complete with StatusFlushed; buffers of operations in flight
	// are no longer touched once Close returns. Close is safe to call twice.
	Close() error
}

// CompletionHandler is implemented by a Conn that can deliver its
// completions by calling a function, on the goroutine where they arise,
// instead of through Poll: the software provider, whose completions arise
// on the goroutine reading its stream. A caller whose completion handling
// never blocks saves a goroutine switch per completion with it. A verbs
// Conn does not implement it: there Poll's goroutine is where completions
// arise.
type CompletionHandler interface {
	// HandleCompletions makes the Conn call fn with the completions that
	// arise from then on, in the order Poll would return them, instead of
	// queueing them for Poll; completions already queued are delivered
	// first. It is called at most once per Conn, before Poll is ever
	// called; Poll must not be called after it.
	//
	// fn is called from one goroutine at a time, with no lock of the Conn
	// held, so it may post, register and close; it must not block (a
	// PostSend that waits for room, a wait for another completion), since
	// the Conn executes nothing of its peer's while fn runs. cs is only
	// valid during the call. Once the connection is closed or broken and
	// every completion has been delivered, fn is called one last time with
	// a nil cs and an error matching ErrClosed (or ErrDeviceRemoved), and
	// never again.
	HandleCompletions(fn func(cs []Completion, err error))
}

// Limits are the sizes of a connection's queues.
type Limits struct {
	// SendQueueDepth is how many send work requests may be outstanding.
	SendQueueDepth int
	// RecvQueueDepth is how many receives may be posted at once.
	RecvQueueDepth int
	// MaxReadsInFlight bounds outstanding RDMA READs (initiator depth).
	MaxReadsInFlight int
	// MaxPrivateData is the largest private data accepted by Dial and Accept.
	MaxPrivateData int
}

// ConnRequest is an incoming connection that the listener's owner accepts
// or rejects, as an RDMA CM connect request.
type ConnRequest interface {
	// PrivateData is what the connecting peer sent.
	PrivateData() []byte
	// RemoteAddr describes the peer for logs.
	RemoteAddr() string
	// Prepare sets the connection up before it is accepted and returns it,
	// so that what the accept announces is true when the peer learns it:
	// its queue pair exists, so regions may be registered on it and
	// receives posted, and those receives are there for the peer's first
	// SENDs, which may come as soon as its Dial returns. Until Accept
	// returns, PostSend fails with ErrNotAccepted and Poll must not be
	// called. Accept then returns this same Conn; Accept without Prepare
	// works as well, with nothing posted before it. A second Prepare
	// returns the same Conn.
	//
	// Once the request is rejected, or Accept failed answering it, the
	// prepared Conn is closed: its receives complete with StatusFlushed and
	// Poll then reports ErrClosed. Its owner still calls Close (as for any Conn)
	// before freeing the memory of its regions. Closing the prepared Conn
	// before Accept rejects the request.
	Prepare() (Conn, error)
	// Accept completes the connection, sending privateData to the peer.
	// It returns the Conn of Prepare if Prepare was called.
	Accept(ctx context.Context, privateData []byte) (Conn, error)
	// Reject refuses it; the peer's Dial fails with a *RejectError that
	// carries privateData.
	Reject(privateData []byte) error
}

// Listener accepts incoming connections.
type Listener interface {
	// Accept waits for the next connection request.
	Accept(ctx context.Context) (ConnRequest, error)
	// Addr is the address being listened on.
	Addr() string
	// Close stops listening; a blocked Accept returns ErrClosed. Connections
	// already accepted stay up. Safe to call twice.
	Close() error
}

// Provider creates connections of one kind (software over TCP, verbs).
type Provider interface {
	// Name is "tcp", "unix" or "rdma".
	Name() string
	// Listen listens on addr (host:port, or a path for unix).
	Listen(ctx context.Context, addr string) (Listener, error)
	// Dial connects to addr, sending privateData; the peer's accept private
	// data is the returned Conn's PeerPrivateData.
	Dial(ctx context.Context, addr string, privateData []byte) (Conn, error)
}

// RejectError is returned by Dial when the peer rejected the connection.
type RejectError struct {
	PrivateData []byte
}

func (e *RejectError) Error() string { return "connection rejected by peer" }

var (
	// ErrClosed is returned by operations on a closed or broken connection
	// or listener.
	ErrClosed = errors.New("transport: connection closed")
	// ErrQueueFull is returned by PostSend or PostRecv when the queue has no room.
	ErrQueueFull = errors.New("transport: work queue full")
	// ErrRemoteAccess matches completions refused by the peer's memory checks.
	ErrRemoteAccess = errors.New("transport: remote access error")
	// ErrNoDevice is returned by providers that need hardware when none exists.
	ErrNoDevice = errors.New("transport: no RDMA device")
	// ErrUnsupported is returned by a provider built without its
	// dependencies, and by an optional feature (WindowBinder.BindWindow)
	// that the device lacks.
	ErrUnsupported = errors.New("transport: provider not supported in this build")
	// ErrFileMapping matches the error of Register for memory that is a
	// mapping of a file: see CheckNotFileMapping.
	ErrFileMapping = errors.New("transport: memory is a file mapping")
	// ErrDeviceRemoved is returned by a Listener's Accept, and reported by
	// the Poll of a connection, when the RDMA device they use was removed
	// (RDMA_CM_EVENT_DEVICE_REMOVAL). It is not ErrClosed: a server's
	// accept loop must fail on it, not end as after an orderly Close.
	ErrDeviceRemoved = errors.New("transport: RDMA device removed")
	// ErrNotAccepted is returned by PostSend on a Conn of
	// ConnRequest.Prepare before the request is accepted.
	ErrNotAccepted = errors.New("transport: connection not accepted yet")
	// ErrDeregisterFailed matches the error of a Region's Deregister that
	// failed, leaving the memory registered (quarantined): see
	// Region.Deregister.
	ErrDeregisterFailed = errors.New("transport: deregistration failed; memory quarantined")
)
