package tcp

import (
	"encoding/binary"
	"fmt"
)

// Wire constants. The layout is drawn in the package documentation.
const (
	headerLen = 32     // bytes of every frame header
	magic     = 0x5242 // "RB"
	version   = 1      // protocol version, carried in the status byte of CONNECT and ACCEPT

	// maxPayload bounds the payload of any frame and so the length of one
	// work request, like max_msg_sz of an RDMA device.
	maxPayload = 1 << 30
)

// Private data limits, as those of RDMA CM on a reliable connection.
const (
	// MaxConnectPrivateData is the largest private data Dial sends.
	MaxConnectPrivateData = 56
	// MaxAcceptPrivateData is the largest private data ConnRequest.Accept sends.
	MaxAcceptPrivateData = 196
	// MaxRejectPrivateData is the largest private data ConnRequest.Reject sends.
	MaxRejectPrivateData = 148
)

// frameType is the kind of a frame.
type frameType uint8

const (
	frameConnect  frameType = 1 + iota // dialer → listener: private data; imm = initiator depth
	frameAccept                        // listener → dialer: private data; imm = initiator depth
	frameReject                        // listener → dialer: private data
	frameSend                          // SEND: payload is the message
	frameWrite                         // RDMA WRITE: payload goes to addr/rkey
	frameWriteImm                      // RDMA WRITE WITH IMMEDIATE: as WRITE, plus imm, consumes a RECV
	frameReadReq                       // RDMA READ request: imm = length to read at addr/rkey
	frameReadResp                      // RDMA READ response: payload is the data, seq the READ's
	frameAck                           // cumulative acknowledgement: every request up to seq executed
	frameNak                           // request seq failed with the status in the status byte
	frameTypeEnd
)

var frameNames = [...]string{"invalid", "CONNECT", "ACCEPT", "REJECT", "SEND", "WRITE", "WRITE_IMM", "READ_REQ", "READ_RESP", "ACK", "NAK"}

func (t frameType) String() string {
	if int(t) < len(frameNames) {
		return frameNames[t]
	}
	return fmt.Sprintf("frame(%d)", uint8(t))
}

// header is one encoded frame header. All fields are big endian.
type header [headerLen]byte

func (h *header) magic() uint16  { return binary.BigEndian.Uint16(h[0:2]) }
func (h *header) typ() frameType { return frameType(h[2]) }
func (h *header) status() uint8  { return h[3] }
func (h *header) length() uint32 { return binary.BigEndian.Uint32(h[4:8]) }
func (h *header) seq() uint64    { return binary.BigEndian.Uint64(h[8:16]) }
func (h *header) addr() uint64   { return binary.BigEndian.Uint64(h[16:24]) }
func (h *header) rkey() uint32   { return binary.BigEndian.Uint32(h[24:28]) }
func (h *header) imm() uint32    { return binary.BigEndian.Uint32(h[28:32]) }
func (h *header) String() string {
	return fmt.Sprintf("%v len=%d seq=%d", h.typ(), h.length(), h.seq())
}

// put encodes every field of h.
func (h *header) put(t frameType, status uint8, length uint32, seq, addr uint64, rkey, imm uint32) {
	binary.BigEndian.PutUint16(h[0:2], magic)
	h[2] = byte(t)
	h[3] = status
	binary.BigEndian.PutUint32(h[4:8], length)
	binary.BigEndian.PutUint64(h[8:16], seq)
	binary.BigEndian.PutUint64(h[16:24], addr)
	binary.BigEndian.PutUint32(h[24:28], rkey)
	binary.BigEndian.PutUint32(h[28:32], imm)
}

// check validates what every frame must satisfy: the magic, a known type and
// a sane payload length.
func (h *header) check() error {
	if m := h.magic(); m != magic {
		return fmt.Errorf("bad frame magic %#04x", m)
	}
	if t := h.typ(); t == 0 || t >= frameTypeEnd {
		return fmt.Errorf("unknown frame type %d", uint8(t))
	}
	if n := h.length(); n > maxPayload {
		return fmt.Errorf("%v frame length %d exceeds %d", h.typ(), n, maxPayload)
	}
	switch h.typ() {
	case frameReadReq, frameAck, frameNak:
		if h.length() != 0 {
			return fmt.Errorf("%v frame with a payload of %d bytes", h.typ(), h.length())
		}
	}
	return nil
}
