package protocol

import (
	"encoding/binary"
	"fmt"
	"slices"
)

const (
	// Magic opens every message: "RBLK" in ASCII.
	Magic uint32 = 0x52424C4B
	// Version is the protocol version this package speaks. Hello is always
	// framed with version 1 so that any peer can read it.
	Version uint8 = 1
	// HeaderSize is the size of the fixed header that starts every message.
	HeaderSize = 24
	// MaxMessageSize bounds a whole message, header included. Receive buffers
	// of this size can take any message.
	MaxMessageSize = 4096
	// MaxPayloadSize is the largest payload after the header.
	MaxPayloadSize = MaxMessageSize - HeaderSize
	// MaxNameLen bounds an export name, in bytes.
	MaxNameLen = 255
	// MaxErrorText bounds the text of an Error message, in bytes.
	MaxErrorText = 1024
	// MaxDoneRanges is the largest number of ranges one Done can carry: as
	// many as fit in MaxMessageSize.
	MaxDoneRanges = (MaxPayloadSize - doneFixedSize) / rangeSize
)

// Type is the kind of a message, in the header's type byte.
type Type uint8

// Message types.
const (
	TypeHello         Type = 1  // Hello: connection private data in both directions
	TypeError         Type = 2  // ErrorMsg: the reply to a request that failed
	TypeListExports   Type = 3  // ListExports: initiator asks for the exports
	TypeExportList    Type = 4  // ExportList: reply to ListExports
	TypeOpen          Type = 5  // Open: initiator opens an export
	TypeVolumeInfo    Type = 6  // VolumeInfo: reply to Open
	TypeGrantRequest  Type = 7  // GrantRequest: initiator asks for a chunk
	TypeGrant         Type = 8  // Grant: reply to GrantRequest
	TypeRevoke        Type = 9  // Revoke: target takes a grant back
	TypeRevokeAck     Type = 10 // RevokeAck: reply to Revoke
	TypeDone          Type = 11 // Done: initiator reports ranges it wrote
	TypeOK            Type = 12 // OK: success reply without data
	TypeFlush         Type = 13 // Flush: make earlier Done ranges durable
	TypeTrim          Type = 14 // Trim: discard a range
	TypeWriteZeroes   Type = 15 // WriteZeroes: zero a range
	TypeClose         Type = 16 // Close: release a handle
	TypeCredit        Type = 17 // Credit: returns credits, nothing else
	TypeKeepAlive     Type = 18 // KeepAlive: either side checks a quiet link; reply OK
	TypeAuthStart     Type = 19 // AuthStart: initiator names itself, first request of a session
	TypeAuthChallenge Type = 20 // AuthChallenge: reply to AuthStart
	TypeAuthResponse  Type = 21 // AuthResponse: initiator's proof
	TypeAuthAccept    Type = 22 // AuthAccept: reply to AuthResponse, the target's proof
	TypeJoin          Type = 23 // Join: initiator adds a connection to its session as an IO queue
	TypeResize        Type = 24 // Resize: target's notice that a volume grew

	typeMax = TypeResize
)

var typeNames = [...]string{
	TypeHello:         "Hello",
	TypeError:         "Error",
	TypeListExports:   "ListExports",
	TypeExportList:    "ExportList",
	TypeOpen:          "Open",
	TypeVolumeInfo:    "VolumeInfo",
	TypeGrantRequest:  "GrantRequest",
	TypeGrant:         "Grant",
	TypeRevoke:        "Revoke",
	TypeRevokeAck:     "RevokeAck",
	TypeDone:          "Done",
	TypeOK:            "OK",
	TypeFlush:         "Flush",
	TypeTrim:          "Trim",
	TypeWriteZeroes:   "WriteZeroes",
	TypeClose:         "Close",
	TypeCredit:        "Credit",
	TypeKeepAlive:     "KeepAlive",
	TypeAuthStart:     "AuthStart",
	TypeAuthChallenge: "AuthChallenge",
	TypeAuthResponse:  "AuthResponse",
	TypeAuthAccept:    "AuthAccept",
	TypeJoin:          "Join",
	TypeResize:        "Resize",
}

func (t Type) String() string {
	if t >= TypeHello && t <= typeMax {
		return typeNames[t]
	}
	return fmt.Sprintf("Type(%d)", uint8(t))
}

// Header is the fixed part of every message. Magic, version and the reserved
// word are implied: Put writes them and ParseHeader checks them.
type Header struct {
	// Type says how to read the payload.
	Type Type
	// Credits is the number of receive buffers the sender re-posted for its
	// peer since its previous message (see the package doc, flow control).
	Credits uint16
	// Length is the number of payload bytes after the header.
	Length uint32
	// Tag is the request id chosen by the requester; a reply carries the tag
	// of its request.
	Tag uint64
}

// Put writes the header into b[:HeaderSize]. It panics if b is shorter.
func (h Header) Put(b []byte) {
	_ = b[HeaderSize-1]
	binary.BigEndian.PutUint32(b[0:], Magic)
	b[4] = Version
	b[5] = uint8(h.Type)
	binary.BigEndian.PutUint16(b[6:], h.Credits)
	binary.BigEndian.PutUint32(b[8:], h.Length)
	binary.BigEndian.PutUint32(b[12:], 0)
	binary.BigEndian.PutUint64(b[16:], h.Tag)
}

// ParseHeader reads the header at the start of b. It checks the magic, the
// version, the reserved word and that Length is at most MaxPayloadSize. It
// does not check that b holds the payload, nor that the type is known: the
// caller slices b[HeaderSize:HeaderSize+h.Length] after checking its length
// and dispatches on h.Type.
func ParseHeader(b []byte) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("decode header: %w: %d bytes", ErrTruncated, len(b))
	}
	if m := binary.BigEndian.Uint32(b[0:]); m != Magic {
		return Header{}, fmt.Errorf("decode header: %w: %#08x", ErrBadMagic, m)
	}
	if v := b[4]; v != Version {
		return Header{}, fmt.Errorf("decode header: %w: %d", ErrVersion, v)
	}
	if binary.BigEndian.Uint32(b[12:]) != 0 {
		return Header{}, fmt.Errorf("decode header: %w", ErrReserved)
	}
	h := Header{
		Type:    Type(b[5]),
		Credits: binary.BigEndian.Uint16(b[6:]),
		Length:  binary.BigEndian.Uint32(b[8:]),
		Tag:     binary.BigEndian.Uint64(b[16:]),
	}
	if h.Length > MaxPayloadSize {
		return Header{}, fmt.Errorf("decode header: %w: payload of %d bytes", ErrTooLarge, h.Length)
	}
	return h, nil
}

// Message is the payload of one message type. The pointer types of this
// package (*Hello, *ErrorMsg, ..., *Credit, *KeepAlive) implement it.
type Message interface {
	// Type is the message type.
	Type() Type
	// Size is the payload size in bytes.
	Size() int
	// MarshalTo writes the payload into b[:Size()] and returns Size(). b must
	// be large enough. It does not validate the fields: Append does.
	MarshalTo(b []byte) int
	// Unmarshal parses exactly payload: trailing bytes are an error. Slices
	// reuse the receiver's backing arrays, so decoding into the same value
	// again does not allocate. On error the receiver's contents are
	// unspecified.
	Unmarshal(payload []byte) error
}

// validator is implemented by every message of this package: it checks the
// fields the way Unmarshal does, so that whatever Append encodes decodes.
type validator interface {
	validate() error
}

// Append encodes m with a header (Length is m.Size()) onto dst and returns
// the extended slice. If dst has room (cap(dst)-len(dst) >= HeaderSize +
// m.Size()) it does not allocate. It returns dst unchanged and an error if a
// field is invalid (ErrBadField, ErrReserved) or the message would exceed
// MaxMessageSize (ErrTooLarge).
func Append(dst []byte, credits uint16, tag uint64, m Message) ([]byte, error) {
	if m == nil {
		return dst, fmt.Errorf("encode: %w: nil message", ErrBadField)
	}
	t := m.Type()
	if t < TypeHello || t > typeMax {
		return dst, fmt.Errorf("encode %v: %w", t, ErrUnknownType)
	}
	if v, ok := m.(validator); ok {
		if err := v.validate(); err != nil {
			return dst, fmt.Errorf("encode %v: %w", t, err)
		}
	}
	n := m.Size()
	if n < 0 || n > MaxPayloadSize {
		return dst, fmt.Errorf("encode %v: %w: payload of %d bytes", t, ErrTooLarge, n)
	}
	start := len(dst)
	dst = slices.Grow(dst, HeaderSize+n)[:start+HeaderSize+n]
	Header{Type: t, Credits: credits, Length: uint32(n), Tag: tag}.Put(dst[start:])
	m.MarshalTo(dst[start+HeaderSize:])
	return dst, nil
}

// Decode parses one whole message, header and payload, with len(b) ==
// HeaderSize+Length, into a newly allocated Message of the header's type.
// It is meant for tests, tools and fuzzing; the data path uses ParseHeader
// and the Unmarshal method of a reused message.
func Decode(b []byte) (Header, Message, error) {
	h, err := ParseHeader(b)
	if err != nil {
		return Header{}, nil, err
	}
	m, err := New(h.Type)
	if err != nil {
		return Header{}, nil, fmt.Errorf("decode %v: %w", h.Type, ErrUnknownType)
	}
	if n := HeaderSize + int(h.Length); len(b) < n {
		return Header{}, nil, fmt.Errorf("decode %v: %w: %d of %d bytes", h.Type, ErrTruncated, len(b), n)
	} else if len(b) > n {
		return Header{}, nil, fmt.Errorf("decode %v: %w: message of more than %d bytes", h.Type, ErrTrailing, n)
	}
	if err := m.Unmarshal(b[HeaderSize:]); err != nil {
		return Header{}, nil, err
	}
	return h, m, nil
}

// New returns a zero message of type t, or ErrUnknownType.
func New(t Type) (Message, error) {
	switch t {
	case TypeHello:
		return new(Hello), nil
	case TypeError:
		return new(ErrorMsg), nil
	case TypeListExports:
		return new(ListExports), nil
	case TypeExportList:
		return new(ExportList), nil
	case TypeOpen:
		return new(Open), nil
	case TypeVolumeInfo:
		return new(VolumeInfo), nil
	case TypeGrantRequest:
		return new(GrantRequest), nil
	case TypeGrant:
		return new(Grant), nil
	case TypeRevoke:
		return new(Revoke), nil
	case TypeRevokeAck:
		return new(RevokeAck), nil
	case TypeDone:
		return new(Done), nil
	case TypeOK:
		return new(OK), nil
	case TypeFlush:
		return new(Flush), nil
	case TypeTrim:
		return new(Trim), nil
	case TypeWriteZeroes:
		return new(WriteZeroes), nil
	case TypeClose:
		return new(Close), nil
	case TypeCredit:
		return new(Credit), nil
	case TypeKeepAlive:
		return new(KeepAlive), nil
	case TypeAuthStart:
		return new(AuthStart), nil
	case TypeAuthChallenge:
		return new(AuthChallenge), nil
	case TypeAuthResponse:
		return new(AuthResponse), nil
	case TypeAuthAccept:
		return new(AuthAccept), nil
	case TypeJoin:
		return new(Join), nil
	case TypeResize:
		return new(Resize), nil
	}
	return nil, fmt.Errorf("%w: %d", ErrUnknownType, uint8(t))
}

// Negotiate picks the version and features of a connection from the local
// Hello and the peer's: the highest version both support, and the features
// both offer that this package knows (FeatureMask). It returns ErrVersion if
// the version ranges do not overlap.
func Negotiate(local, peer Hello) (version uint8, features uint32, err error) {
	lo := max(local.MinVersion, peer.MinVersion, 1)
	hi := min(local.MaxVersion, peer.MaxVersion)
	if hi < lo {
		return 0, 0, fmt.Errorf("%w: local %d..%d, peer %d..%d", ErrVersion,
			local.MinVersion, local.MaxVersion, peer.MinVersion, peer.MaxVersion)
	}
	return hi, local.Features & peer.Features & FeatureMask, nil
}
