package verbs

import (
	"fmt"
	"net/netip"
	"time"
	"unsafe"
)

// The provider's view of the RDMA CM and the verbs: small interfaces that
// the cgo layer (verbs.go, verbs.c; build tag rdma) implements over
// librdmacm and libibverbs, and that transport/rdma's tests implement with
// a device in Go. Nothing here needs cgo: the ring, completion and
// connection logic above it builds, and is tested, without it.
//
// The hot paths stay one call into C each: a chain of work requests is
// built in SendBuf or RecvBuf (C memory owned by the QP on a real device)
// and posted with one PostSend or PostRecv; completions are polled in
// batches into WCs (C memory owned by the CQ).

// Stack opens event channels and ids of the RDMA CM: the entry point of a
// provider (Open, in a build with the tag rdma).
type Stack interface {
	// NewEventChannel is rdma_create_event_channel, made non-blocking.
	NewEventChannel() (EventChannel, error)
	// NewID is rdma_create_id on ch (RDMA_PS_TCP: reliable connections).
	NewID(ch EventChannel) (CMID, error)
}

// EventChannel is an rdma_event_channel whose fd is non-blocking.
type EventChannel interface {
	// Fd is readable when an event is queued.
	Fd() int
	// GetEvent takes the next event without blocking (and acknowledges
	// it): syscall.EAGAIN when there is none. One goroutine at a time.
	GetEvent() (Event, error)
	// Destroy destroys the channel; its ids must be destroyed or migrated.
	Destroy()
}

// CMID is an rdma_cm_id.
type CMID interface {
	// Bind is rdma_bind_addr.
	Bind(ap netip.AddrPort) error
	// Listen is rdma_listen.
	Listen(backlog int) error
	// ResolveAddr is rdma_resolve_addr: EventAddrResolved or
	// EventAddrError follows.
	ResolveAddr(dst netip.AddrPort, timeout time.Duration) error
	// ResolveRoute is rdma_resolve_route: EventRouteResolved or
	// EventRouteError follows.
	ResolveRoute(timeout time.Duration) error
	// Migrate is rdma_migrate_id: the id's events go to ch from now on.
	Migrate(ch EventChannel) error
	// CreateQP is rdma_create_qp: an RC QP on pd whose queues complete on
	// cq, with selective signaling (sq_sig_all = 0), in INIT (receives may
	// be posted), with the arrays chains of up to chunk requests are
	// posted from.
	CreateQP(pd PD, cq CQ, want QPCaps, chunk int) (QP, error)
	// Connect is rdma_connect; the id must have its QP.
	Connect(p ConnParam) error
	// Accept is rdma_accept; the id must have its QP.
	Accept(p ConnParam) error
	// Reject is rdma_reject.
	Reject(privateData []byte) error
	// Disconnect is rdma_disconnect: the QP moves to the error state
	// (which flushes its work requests) and the peer is told; both ends
	// get EventDisconnected.
	Disconnect() error
	// Destroy is rdma_destroy_id; its QP must be destroyed first.
	Destroy() error
	// Context is the device context the id is bound to, or nil.
	Context() Context
	// LocalAddr is rdma_get_local_addr.
	LocalAddr() netip.AddrPort
	// PeerAddr is rdma_get_peer_addr.
	PeerAddr() netip.AddrPort
	// DeviceName names the device the id is bound to, or "".
	DeviceName() string
	// Port is the device port the id is bound to.
	Port() int
	// SGID is the source GID of the id's route.
	SGID() [16]byte
}

// Context is a device context (ibv_context), owned by the RDMA CM.
type Context interface {
	// QueryDevice is ibv_query_device.
	QueryDevice() (DeviceAttr, error)
	// AllocPD is ibv_alloc_pd.
	AllocPD() (PD, error)
	// NewCompChannel is ibv_create_comp_channel, made non-blocking.
	NewCompChannel() (CompChannel, error)
	// NewCQ is ibv_create_cq with cqe entries on ch, on completion vector
	// vector; Poll returns up to batch completions per call.
	NewCQ(cqe int, ch CompChannel, batch, vector int) (CQ, error)
	// NumCompVectors is num_comp_vectors, at least 1.
	NumCompVectors() int
}

// PD is a protection domain.
type PD interface {
	// RegMR is ibv_reg_mr over [addr, addr+length), memory outside the Go
	// heap that stays mapped until Dereg.
	RegMR(addr unsafe.Pointer, length int, access int) (MR, error)
	// AllocMW is ibv_alloc_mw of a type-2 window: EOPNOTSUPP (or ENOSYS)
	// on a device without.
	AllocMW() (MW, error)
	// Dealloc is ibv_dealloc_pd; every MR, MW and QP on it must be gone.
	Dealloc() error
}

// MR is a registered memory region.
type MR interface {
	LKey() uint32
	RKey() uint32
	// Dereg is ibv_dereg_mr. If it fails the MR stays registered (the
	// device may still use its keys) and Dereg may be called again.
	Dereg() error
}

// MW is a type-2 memory window.
type MW interface {
	// RKey is its current key: that of its last bind posted, or the one
	// ibv_alloc_mw gave.
	RKey() uint32
	// Dealloc is ibv_dealloc_mw; no request on the window may be in
	// flight. Safe to call twice.
	Dealloc() error
}

// QP is the RC queue pair of a CMID.
type QP interface {
	// Num is the QP number.
	Num() uint32
	// Caps are the sizes the device gave.
	Caps() QPCaps
	// SendBuf is where a chain of up to len(SendBuf()) send requests is
	// built for PostSend; the caller serializes its use.
	SendBuf() []WR
	// RecvBuf is SendBuf for receives.
	RecvBuf() []WR
	// PostSend posts SendBuf()[:n] with one ibv_post_send. On failure it
	// returns how many were posted before the one refused.
	PostSend(n int) (int, error)
	// PostRecv posts RecvBuf()[:n] with one ibv_post_recv.
	PostRecv(n int) (int, error)
	// PostBindMW posts a signaled IBV_WR_BIND_MW with wr_id id, binding mw
	// to the QP over [addr, addr+length) of mr with the remote access
	// flags access under rkey (IncRKey(mw.RKey())); mw.RKey() is rkey once
	// it is posted. It is posted alone, outside SendBuf.
	PostBindMW(id uint64, mw MW, mr MR, addr, length uint64, access int, rkey uint32) error
	// PostLocalInv posts a signaled IBV_WR_LOCAL_INV of rkey with wr_id id.
	PostLocalInv(id uint64, rkey uint32) error
	// PostDrain posts a signaled zero-length RDMA WRITE with wr_id id,
	// alone: its completion comes after those of everything posted
	// before it, flushed if the QP is in the error state.
	PostDrain(id uint64) error
	// SetMinRNRTimer sets the RNR NAK timer the QP asks its peer to wait
	// (IB encoding: 12 is 0.64 ms), in RTS.
	SetMinRNRTimer(v uint8) error
	// ToError moves the QP to the error state: the device flushes every
	// work request outstanding, and those posted later.
	ToError() error
	// Destroy is rdma_destroy_qp; it frees the posting arrays.
	Destroy() error
}

// CompChannel is a completion channel whose fd is non-blocking.
type CompChannel interface {
	// Fd is readable when a completion event is queued.
	Fd() int
	// GetEvent consumes one completion event without blocking and reports
	// whether there was one; the caller acknowledges it with
	// CQ.AckEvents.
	GetEvent() (bool, error)
	// Destroy is ibv_destroy_comp_channel; its CQs must be gone.
	Destroy() error
}

// CQ is a completion queue with the buffer Poll fills.
type CQ interface {
	// Poll polls up to max completions (at most the batch) into WCs().
	// With arm, when there is none it arms the CQ for the next completion
	// and polls once more.
	Poll(max int, arm bool) (int, error)
	// PollSpin polls until completions come or budget passes.
	PollSpin(max int, budget time.Duration) (int, error)
	// WCs is the buffer Poll fills.
	WCs() []WC
	// AckEvents is ibv_ack_cq_events.
	AckEvents(n int)
	// Destroy is ibv_destroy_cq; every event must be acknowledged and the
	// QPs using it destroyed.
	Destroy() error
}

// WR is a work request as the C side reads it: a span of a registered
// region (Addr, Length, LKey), the peer's memory for one-sided operations
// (RAddr, RKey), immediate data in host order, an ibv_wr_opcode and
// ibv_send_flags. Its layout is that of struct rblk_wr (verbs.h).
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

// WC is a completion as the C side writes it: Imm in host order. Its
// layout is that of struct rblk_wc (verbs.h).
type WC struct {
	ID        uint64
	Status    uint32
	Opcode    uint32
	ByteLen   uint32
	Imm       uint32
	VendorErr uint32
	Flags     uint32
}

// QPCaps are the sizes of a queue pair.
type QPCaps struct {
	SendWR, RecvWR, InlineData int
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

// Event is a connection manager event, already acknowledged. ID is the
// id of a connect request (a new one); for other events the provider
// knows its id by the channel.
type Event struct {
	Type     EventType
	Status   int
	ID       CMID
	ListenID CMID
	Conn     ConnParam
}

// The constants below are values of the rdma-core ABI (verbs.h,
// rdma_cma.h); verbs.go checks each against the headers at compile time.

// Work request opcodes and flags (ibv_wr_opcode, ibv_send_flags).
const (
	WRRDMAWrite    = 0
	WRRDMAWriteImm = 1
	WRSend         = 2
	WRRDMARead     = 4
	WRLocalInv     = 7
	WRBindMW       = 8

	FlagSignaled = 1 << 1
	FlagInline   = 1 << 3
)

// Completion opcodes (ibv_wc_opcode) and wc_flags.
const (
	WCSend            = 0
	WCRDMAWrite       = 1
	WCRDMARead        = 2
	WCBindMW          = 5
	WCLocalInv        = 6
	WCRecv            = 1 << 7
	WCRecvRDMAWithImm = WCRecv + 1
	WCFlagWithImm     = 1 << 1
)

// Access flags (ibv_access_flags).
const (
	AccessLocalWrite  = 1 << 0
	AccessRemoteWrite = 1 << 1
	AccessRemoteRead  = 1 << 2
	AccessMWBind      = 1 << 4
)

// Completion statuses (ibv_wc_status).
const (
	WCSuccess        = 0
	WCLocLenErr      = 1
	WCLocQPOpErr     = 2
	WCLocProtErr     = 4
	WCWRFlushErr     = 5
	WCMWBindErr      = 6
	WCRemInvReqErr   = 9
	WCRemAccessErr   = 10
	WCRemOpErr       = 11
	WCRetryExcErr    = 12
	WCRNRRetryExcErr = 13
	WCGeneralErr     = 21
)

// statusText is ibv_wc_status_str of each ibv_wc_status.
var statusText = [...]string{
	"success", "local length error", "local QP operation error", "local EE context operation error",
	"local protection error", "Work Request Flushed Error", "memory management operation error",
	"bad response error", "local access error", "remote invalid request error", "remote access error",
	"remote operation error", "transport retry counter exceeded", "RNR retry counter exceeded",
	"local RDD violation error", "remote invalid RD request", "aborted error", "invalid EE context number",
	"invalid EE context state", "fatal error", "response timeout error", "general error",
	"TM error", "TM software rendezvous",
}

// StatusString is ibv_wc_status_str.
func StatusString(status uint32) string {
	if int(status) < len(statusText) {
		return statusText[status]
	}
	return "unknown"
}

// IncRKey is ibv_inc_rkey: rkey with its 8 low bits (the key a consumer
// chooses) incremented.
func IncRKey(rkey uint32) uint32 { return rkey&^0xff | (rkey+1)&0xff }

// EventType is an rdma_cm_event_type.
type EventType int

// Connection manager event types (rdma_cm_event_type).
const (
	EventAddrResolved EventType = iota
	EventAddrError
	EventRouteResolved
	EventRouteError
	EventConnectRequest
	EventConnectResponse
	EventConnectError
	EventUnreachable
	EventRejected
	EventEstablished
	EventDisconnected
	EventDeviceRemoval
	EventMulticastJoin
	EventMulticastError
	EventAddrChange
	EventTimewaitExit
)

// eventText is rdma_event_str of each event type.
var eventText = [...]string{
	"RDMA_CM_EVENT_ADDR_RESOLVED", "RDMA_CM_EVENT_ADDR_ERROR", "RDMA_CM_EVENT_ROUTE_RESOLVED",
	"RDMA_CM_EVENT_ROUTE_ERROR", "RDMA_CM_EVENT_CONNECT_REQUEST", "RDMA_CM_EVENT_CONNECT_RESPONSE",
	"RDMA_CM_EVENT_CONNECT_ERROR", "RDMA_CM_EVENT_UNREACHABLE", "RDMA_CM_EVENT_REJECTED",
	"RDMA_CM_EVENT_ESTABLISHED", "RDMA_CM_EVENT_DISCONNECTED", "RDMA_CM_EVENT_DEVICE_REMOVAL",
	"RDMA_CM_EVENT_MULTICAST_JOIN", "RDMA_CM_EVENT_MULTICAST_ERROR", "RDMA_CM_EVENT_ADDR_CHANGE",
	"RDMA_CM_EVENT_TIMEWAIT_EXIT",
}

// String is rdma_event_str.
func (t EventType) String() string {
	if t >= 0 && int(t) < len(eventText) {
		return eventText[t]
	}
	return fmt.Sprintf("RDMA_CM_EVENT(%d)", int(t))
}
