//go:build linux && cgo && rdma

package verbs

/*
#cgo LDFLAGS: -libverbs -lrdmacm
#include <stdlib.h>
#include "verbs.h"
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

// The Go and C layouts of work requests and completions, and the ABI
// constants of device.go, agree: each line is an array whose length would
// be negative (a compile error) otherwise.
var (
	_ [unsafe.Sizeof(WR{}) - C.RBLK_WR_SIZE]struct{}
	_ [C.RBLK_WR_SIZE - unsafe.Sizeof(WR{})]struct{}
	_ [unsafe.Offsetof(WR{}.Opcode) - C.RBLK_WR_OPCODE]struct{}
	_ [C.RBLK_WR_OPCODE - unsafe.Offsetof(WR{}.Opcode)]struct{}
	_ [unsafe.Sizeof(WC{}) - C.RBLK_WC_SIZE]struct{}
	_ [C.RBLK_WC_SIZE - unsafe.Sizeof(WC{})]struct{}
	_ [unsafe.Offsetof(WC{}.VendorErr) - C.RBLK_WC_VENDOR]struct{}
	_ [C.RBLK_WC_VENDOR - unsafe.Offsetof(WC{}.VendorErr)]struct{}
)

// Each abi constant is zero when the constants of device.go are the
// headers' values; the arrays below have a negative length otherwise.
const (
	abiWR = (WRRDMAWrite ^ C.IBV_WR_RDMA_WRITE) | (WRRDMAWriteImm ^ C.IBV_WR_RDMA_WRITE_WITH_IMM) |
		(WRSend ^ C.IBV_WR_SEND) | (WRRDMARead ^ C.IBV_WR_RDMA_READ) | (WRLocalInv ^ C.IBV_WR_LOCAL_INV) |
		(WRBindMW ^ C.IBV_WR_BIND_MW) | (FlagSignaled ^ C.IBV_SEND_SIGNALED) | (FlagInline ^ C.IBV_SEND_INLINE)
	abiWC = (WCSend ^ C.IBV_WC_SEND) | (WCRDMAWrite ^ C.IBV_WC_RDMA_WRITE) | (WCRDMARead ^ C.IBV_WC_RDMA_READ) |
		(WCBindMW ^ C.IBV_WC_BIND_MW) | (WCLocalInv ^ C.IBV_WC_LOCAL_INV) | (WCRecv ^ C.IBV_WC_RECV) |
		(WCRecvRDMAWithImm ^ C.IBV_WC_RECV_RDMA_WITH_IMM) | (WCFlagWithImm ^ C.IBV_WC_WITH_IMM)
	abiAccess = (AccessLocalWrite ^ C.IBV_ACCESS_LOCAL_WRITE) | (AccessRemoteWrite ^ C.IBV_ACCESS_REMOTE_WRITE) |
		(AccessRemoteRead ^ C.IBV_ACCESS_REMOTE_READ) | (AccessMWBind ^ C.IBV_ACCESS_MW_BIND)
	abiStatus = (WCSuccess ^ C.IBV_WC_SUCCESS) | (WCLocLenErr ^ C.IBV_WC_LOC_LEN_ERR) | (WCLocQPOpErr ^ C.IBV_WC_LOC_QP_OP_ERR) |
		(WCLocProtErr ^ C.IBV_WC_LOC_PROT_ERR) | (WCWRFlushErr ^ C.IBV_WC_WR_FLUSH_ERR) | (WCMWBindErr ^ C.IBV_WC_MW_BIND_ERR) |
		(WCRemInvReqErr ^ C.IBV_WC_REM_INV_REQ_ERR) | (WCRemAccessErr ^ C.IBV_WC_REM_ACCESS_ERR) | (WCRemOpErr ^ C.IBV_WC_REM_OP_ERR) |
		(WCRetryExcErr ^ C.IBV_WC_RETRY_EXC_ERR) | (WCRNRRetryExcErr ^ C.IBV_WC_RNR_RETRY_EXC_ERR) |
		(WCGeneralErr ^ C.IBV_WC_GENERAL_ERR) | (len(statusText) - 1 ^ C.IBV_WC_TM_RNDV_INCOMPLETE)
	abiEvent = (int(EventAddrResolved) ^ C.RDMA_CM_EVENT_ADDR_RESOLVED) | (int(EventConnectRequest) ^ C.RDMA_CM_EVENT_CONNECT_REQUEST) |
		(int(EventRejected) ^ C.RDMA_CM_EVENT_REJECTED) | (int(EventEstablished) ^ C.RDMA_CM_EVENT_ESTABLISHED) |
		(int(EventDisconnected) ^ C.RDMA_CM_EVENT_DISCONNECTED) | (int(EventDeviceRemoval) ^ C.RDMA_CM_EVENT_DEVICE_REMOVAL) |
		(int(EventTimewaitExit) ^ C.RDMA_CM_EVENT_TIMEWAIT_EXIT) | (len(eventText) - 1 ^ C.RDMA_CM_EVENT_TIMEWAIT_EXIT)
)

var (
	_ [-abiWR]struct{}
	_ [-abiWC]struct{}
	_ [-abiAccess]struct{}
	_ [-abiStatus]struct{}
	_ [-abiEvent]struct{}
)

// cStatusString, cEventString and cIncRKey are the library's own, for the
// tests that compare the Go versions with them.
func cStatusString(status uint32) string {
	return C.GoString(C.ibv_wc_status_str(C.enum_ibv_wc_status(status)))
}

func cEventString(t EventType) string {
	return C.GoString(C.rdma_event_str(C.enum_rdma_cm_event_type(t)))
}

func cIncRKey(rkey uint32) uint32 { return uint32(C.rblk_inc_rkey(C.uint32_t(rkey))) }

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

// Open returns the Stack over librdmacm and libibverbs.
func Open() Stack { return cStack{} }

type cStack struct{}

// NewEventChannel creates an event channel and makes its fd non-blocking.
func (cStack) NewEventChannel() (EventChannel, error) {
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
	return &eventChannel{p: p, ev: ev}, nil
}

// NewID creates an id whose events go to ch.
func (cStack) NewID(ch EventChannel) (CMID, error) {
	var p *C.struct_rdma_cm_id
	if r, err := C.rdma_create_id(ch.(*eventChannel).p, &p, nil, C.RDMA_PS_TCP); r != 0 {
		return nil, callErr("rdma_create_id", err)
	}
	return &cmID{p: p}, nil
}

// eventChannel is an rdma_event_channel whose fd is non-blocking.
type eventChannel struct {
	p  *C.struct_rdma_event_channel
	ev *C.struct_rblk_event
}

func (ch *eventChannel) Fd() int { return int(ch.p.fd) }

func (ch *eventChannel) Destroy() {
	if ch.p != nil {
		C.rdma_destroy_event_channel(ch.p)
		C.free(unsafe.Pointer(ch.ev))
		ch.p, ch.ev = nil, nil
	}
}

func (ch *eventChannel) GetEvent() (Event, error) {
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
		Conn: ConnParam{
			ResponderResources: uint8(ev.responder_resources),
			InitiatorDepth:     uint8(ev.initiator_depth),
			FlowControl:        uint8(ev.flow_control),
			RetryCount:         uint8(ev.retry_count),
			RNRRetryCount:      uint8(ev.rnr_retry_count),
		},
	}
	if ev.id != nil {
		out.ID = &cmID{p: ev.id}
	}
	if ev.listen_id != nil {
		out.ListenID = &cmID{p: ev.listen_id}
	}
	if n := int(ev.private_data_len); n > 0 {
		out.Conn.PrivateData = C.GoBytes(unsafe.Pointer(&ev.private_data[0]), C.int(min(n, len(ev.private_data))))
	}
	return out, nil
}

// cmID is an rdma_cm_id of the TCP port space (reliable connections).
type cmID struct {
	p *C.struct_rdma_cm_id
}

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

func (id *cmID) Bind(ap netip.AddrPort) error {
	ss := sockaddr(ap)
	if r, err := C.rdma_bind_addr(id.p, (*C.struct_sockaddr)(unsafe.Pointer(&ss))); r != 0 {
		return callErr("rdma_bind_addr "+ap.String(), err)
	}
	return nil
}

func (id *cmID) Listen(backlog int) error {
	if r, err := C.rdma_listen(id.p, C.int(backlog)); r != 0 {
		return callErr("rdma_listen", err)
	}
	return nil
}

func (id *cmID) ResolveAddr(dst netip.AddrPort, timeout time.Duration) error {
	ss := sockaddr(dst)
	if r, err := C.rdma_resolve_addr(id.p, nil, (*C.struct_sockaddr)(unsafe.Pointer(&ss)), C.int(timeout.Milliseconds())); r != 0 {
		return callErr("rdma_resolve_addr "+dst.String(), err)
	}
	return nil
}

func (id *cmID) ResolveRoute(timeout time.Duration) error {
	if r, err := C.rdma_resolve_route(id.p, C.int(timeout.Milliseconds())); r != 0 {
		return callErr("rdma_resolve_route", err)
	}
	return nil
}

func (id *cmID) Migrate(ch EventChannel) error {
	if r, err := C.rdma_migrate_id(id.p, ch.(*eventChannel).p); r != 0 {
		return callErr("rdma_migrate_id", err)
	}
	return nil
}

func (id *cmID) connect(accept bool, p ConnParam) error {
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

func (id *cmID) Connect(p ConnParam) error { return id.connect(false, p) }
func (id *cmID) Accept(p ConnParam) error  { return id.connect(true, p) }

func (id *cmID) Reject(privateData []byte) error {
	var pd unsafe.Pointer
	if len(privateData) > 0 {
		pd = unsafe.Pointer(&privateData[0])
	}
	if r, err := C.rdma_reject(id.p, pd, C.uint8_t(len(privateData))); r != 0 {
		return callErr("rdma_reject", err)
	}
	return nil
}

func (id *cmID) Disconnect() error {
	if r, err := C.rdma_disconnect(id.p); r != 0 {
		return callErr("rdma_disconnect", err)
	}
	return nil
}

func (id *cmID) Destroy() error {
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

func (id *cmID) Context() Context {
	p := C.rblk_id_verbs(id.p)
	if p == nil {
		return nil
	}
	return &devContext{p: p}
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

func (id *cmID) LocalAddr() netip.AddrPort {
	var ip [16]byte
	var port C.uint16_t
	fam := C.rblk_local_addr(id.p, (*C.uint8_t)(&ip[0]), &port)
	return addrPort(fam, &ip, port)
}

func (id *cmID) PeerAddr() netip.AddrPort {
	var ip [16]byte
	var port C.uint16_t
	fam := C.rblk_peer_addr(id.p, (*C.uint8_t)(&ip[0]), &port)
	return addrPort(fam, &ip, port)
}

func (id *cmID) DeviceName() string { return C.GoString(C.rblk_device_name(id.p)) }
func (id *cmID) Port() int          { return int(C.rblk_id_port(id.p)) }

func (id *cmID) SGID() [16]byte {
	var gid [16]byte
	C.rblk_sgid(id.p, (*C.uint8_t)(&gid[0]))
	return gid
}

func (id *cmID) CreateQP(pd PD, cq CQ, want QPCaps, chunk int) (QP, error) {
	bufs, err := newQPBufs(chunk)
	if err != nil {
		return nil, err
	}
	var caps C.struct_ibv_qp_cap
	if e := C.rblk_create_qp(id.p, pd.(*protDomain).p, cq.(*compQueue).p, C.uint32_t(want.SendWR), C.uint32_t(want.RecvWR), C.uint32_t(want.InlineData), &caps); e != 0 {
		C.rblk_free_qp_bufs(bufs)
		return nil, errnoErr("rdma_create_qp", e)
	}
	caps2 := QPCaps{SendWR: int(caps.max_send_wr), RecvWR: int(caps.max_recv_wr), InlineData: int(caps.max_inline_data)}
	return wrapQP(id, C.rblk_id_qp(id.p), bufs, chunk, caps2), nil
}

func wrapQP(id *cmID, p *C.struct_ibv_qp, bufs *C.struct_rblk_qp_bufs, chunk int, caps QPCaps) *queuePair {
	qp := &queuePair{id: id, p: p, bufs: bufs, caps: caps}
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

// queuePair is the QP of a cmID.
type queuePair struct {
	id   *cmID // nil for a QP of the test fake (fake.go)
	p    *C.struct_ibv_qp
	bufs *C.struct_rblk_qp_bufs
	send []WR
	recv []WR
	caps QPCaps
	// destroy replaces rdma_destroy_qp for a QP of the test fake.
	destroy func()
}

func (qp *queuePair) Num() uint32   { return uint32(C.rblk_qp_num(qp.p)) }
func (qp *queuePair) Caps() QPCaps  { return qp.caps }
func (qp *queuePair) SendBuf() []WR { return qp.send }
func (qp *queuePair) RecvBuf() []WR { return qp.recv }

func (qp *queuePair) PostSend(n int) (int, error) {
	if e := C.rblk_post_send(qp.p, qp.bufs, C.int(n)); e != 0 {
		return int(qp.bufs.send_posted), errnoErr("ibv_post_send", e)
	}
	return n, nil
}

func (qp *queuePair) PostRecv(n int) (int, error) {
	if e := C.rblk_post_recv(qp.p, qp.bufs, C.int(n)); e != 0 {
		return int(qp.bufs.recv_posted), errnoErr("ibv_post_recv", e)
	}
	return n, nil
}

func (qp *queuePair) SetMinRNRTimer(v uint8) error {
	if e := C.rblk_set_min_rnr_timer(qp.p, C.uint8_t(v)); e != 0 {
		return errnoErr("ibv_modify_qp min_rnr_timer", e)
	}
	return nil
}

func (qp *queuePair) ToError() error {
	if e := C.rblk_qp_to_error(qp.p); e != 0 {
		return errnoErr("ibv_modify_qp IBV_QPS_ERR", e)
	}
	return nil
}

func (qp *queuePair) Destroy() error {
	if qp.bufs == nil {
		return nil
	}
	if qp.destroy != nil {
		qp.destroy()
	} else {
		C.rdma_destroy_qp(qp.id.p)
	}
	C.rblk_free_qp_bufs(qp.bufs)
	qp.bufs, qp.p, qp.send, qp.recv = nil, nil, nil, nil
	return nil
}

func (qp *queuePair) PostBindMW(id uint64, mw MW, mr MR, addr, length uint64, access int, rkey uint32) error {
	w := mw.(*memWindow)
	if e := C.rblk_post_bind_mw(qp.p, C.uint64_t(id), w.p, mr.(*memRegion).p, C.uint64_t(addr), C.uint64_t(length), C.uint(access), C.uint32_t(rkey)); e != 0 {
		return errnoErr("ibv_post_send IBV_WR_BIND_MW", e)
	}
	w.rkey = rkey
	return nil
}

func (qp *queuePair) PostDrain(id uint64) error {
	if e := C.rblk_post_drain(qp.p, C.uint64_t(id)); e != 0 {
		return errnoErr("ibv_post_send drain", e)
	}
	return nil
}

func (qp *queuePair) PostLocalInv(id uint64, rkey uint32) error {
	if e := C.rblk_post_local_inv(qp.p, C.uint64_t(id), C.uint32_t(rkey)); e != 0 {
		return errnoErr("ibv_post_send IBV_WR_LOCAL_INV", e)
	}
	return nil
}

// devContext is an ibv_context (owned by librdmacm; never closed here).
type devContext struct {
	p *C.struct_ibv_context
}

func (c *devContext) QueryDevice() (DeviceAttr, error) {
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

func (c *devContext) NumCompVectors() int { return max(1, int(C.rblk_num_comp_vectors(c.p))) }

func (c *devContext) AllocPD() (PD, error) {
	p, err := C.ibv_alloc_pd(c.p)
	if p == nil {
		return nil, callErr("ibv_alloc_pd", err)
	}
	return &protDomain{p: p}, nil
}

// protDomain is a protection domain.
type protDomain struct {
	p *C.struct_ibv_pd
}

func (pd *protDomain) Dealloc() error {
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

func (pd *protDomain) RegMR(addr unsafe.Pointer, length int, access int) (MR, error) {
	p, err := C.ibv_reg_mr(pd.p, addr, C.size_t(length), C.int(access))
	if p == nil {
		return nil, callErr("ibv_reg_mr", err)
	}
	return &memRegion{p: p, lkey: uint32(p.lkey), rkey: uint32(p.rkey)}, nil
}

// memRegion is a registered memory region.
type memRegion struct {
	p          *C.struct_ibv_mr
	lkey, rkey uint32
}

func (mr *memRegion) LKey() uint32 { return mr.lkey }
func (mr *memRegion) RKey() uint32 { return mr.rkey }

func (mr *memRegion) Dereg() error {
	if mr.p == nil {
		return nil
	}
	if e := C.ibv_dereg_mr(mr.p); e != 0 {
		return errnoErr("ibv_dereg_mr", e)
	}
	mr.p = nil
	return nil
}

func (pd *protDomain) AllocMW() (MW, error) {
	p, err := C.rblk_alloc_mw(pd.p)
	if p == nil {
		return nil, callErr("ibv_alloc_mw", err)
	}
	return &memWindow{p: p, rkey: uint32(p.rkey)}, nil
}

// memWindow is a type-2 memory window.
type memWindow struct {
	p    *C.struct_ibv_mw
	rkey uint32
}

func (mw *memWindow) RKey() uint32 { return mw.rkey }

func (mw *memWindow) Dealloc() error {
	if mw.p == nil {
		return nil
	}
	if e := C.rblk_dealloc_mw(mw.p); e != 0 {
		return errnoErr("ibv_dealloc_mw", e)
	}
	mw.p = nil
	return nil
}

func (c *devContext) NewCompChannel() (CompChannel, error) {
	p, err := C.ibv_create_comp_channel(c.p)
	if p == nil {
		return nil, callErr("ibv_create_comp_channel", err)
	}
	if err := syscall.SetNonblock(int(p.fd), true); err != nil {
		C.ibv_destroy_comp_channel(p)
		return nil, fmt.Errorf("completion channel: set non-blocking: %w", err)
	}
	return &compChannel{p: p}, nil
}

// compChannel is a completion channel whose fd is non-blocking.
type compChannel struct {
	p *C.struct_ibv_comp_channel
}

func (ch *compChannel) Fd() int { return int(ch.p.fd) }

func (ch *compChannel) GetEvent() (bool, error) {
	r := C.rblk_get_cq_event(ch.p)
	if r < 0 {
		return false, errnoErr("ibv_get_cq_event", -r)
	}
	return r == 1, nil
}

func (ch *compChannel) Destroy() error {
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

func (c *devContext) NewCQ(cqe int, ch CompChannel, batch, vector int) (CQ, error) {
	wc := (*C.struct_ibv_wc)(C.calloc(C.size_t(batch), C.sizeof_struct_ibv_wc))
	out := (*C.struct_rblk_wc)(C.calloc(C.size_t(batch), C.sizeof_struct_rblk_wc))
	if wc == nil || out == nil {
		C.free(unsafe.Pointer(wc))
		C.free(unsafe.Pointer(out))
		return nil, errors.New("create CQ: out of memory")
	}
	p, err := C.ibv_create_cq(c.p, C.int(cqe), nil, ch.(*compChannel).p, C.int(vector))
	if p == nil {
		C.free(unsafe.Pointer(wc))
		C.free(unsafe.Pointer(out))
		return nil, callErr("ibv_create_cq", err)
	}
	return &compQueue{p: p, wc: wc, out: out, wcs: unsafe.Slice((*WC)(unsafe.Pointer(out)), batch), batch: batch}, nil
}

// compQueue is a completion queue with the buffers Poll fills.
type compQueue struct {
	p     *C.struct_ibv_cq
	wc    *C.struct_ibv_wc
	out   *C.struct_rblk_wc
	wcs   []WC
	batch int
}

func (cq *compQueue) Poll(max int, arm bool) (int, error) {
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

func (cq *compQueue) PollSpin(max int, budget time.Duration) (int, error) {
	max = min(max, cq.batch)
	r := C.rblk_poll_spin(cq.p, cq.wc, cq.out, C.int(max), C.int64_t(budget.Nanoseconds()))
	if r < 0 {
		return 0, errnoErr("ibv_poll_cq", -r)
	}
	return int(r), nil
}

func (cq *compQueue) WCs() []WC { return cq.wcs }

func (cq *compQueue) AckEvents(n int) {
	if n > 0 {
		C.ibv_ack_cq_events(cq.p, C.uint(n))
	}
}

func (cq *compQueue) Destroy() error {
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
