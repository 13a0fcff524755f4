package protocol

import (
	"encoding/binary"
	"fmt"
	"strings"
	"unicode/utf8"
)

var be = binary.BigEndian

// Payload sizes of the fixed-size messages and of the fixed parts of the
// others.
const (
	helloSize        = 16
	errorFixedSize   = 6
	exportListFixed  = 2
	exportEntryFixed = 1 + 8 + 4
	openFixedSize    = 8
	instanceSize     = 8
	joinFixedSize    = 16
	volumeInfoSize   = 40
	grantRequestSize = 16
	grantSize        = 40
	revokeSize       = 24
	doneFixedSize    = 24
	rangeSize        = 16
	flushSize        = 16
	handleOnlySize   = 8
	extentSize       = 24
	resizeSize       = 16
)

// Hello feature bits. A side uses a feature only when both Hellos offer it
// (Negotiate).
const (
	// FeatureOpenInstance: the sender understands an Open with
	// OpenInstance. An initiator sets OpenInstance only when the target's
	// Hello offers it (an older target rejects the flag as reserved).
	FeatureOpenInstance uint32 = 1
)

// FeatureMask is the set of Hello feature bits this package knows.
// Negotiate drops the others.
const FeatureMask = FeatureOpenInstance

// Flag bits of GrantRequest, Grant, Done, Trim and WriteZeroes. Undefined
// bits are reserved: encoders and decoders reject them (ErrReserved).
const (
	// GrantWrite, in GrantRequest, asks for a chunk the initiator may write;
	// in Grant, says the region has remote write access.
	GrantWrite = 1
	// DoneFUA asks the target to reply OK once the ranges of the Done are
	// durable. Without it a Done has no reply unless it fails.
	DoneFUA = 1
	// FlagFUA, in Trim and WriteZeroes, asks for the reply only once the
	// change is durable.
	FlagFUA = 1
	// FlagNoHole, in WriteZeroes, forbids punching a hole: the zeroed range
	// must stay allocated.
	FlagNoHole = 2

	grantFlagsMask = GrantWrite
	doneFlagsMask  = DoneFUA
	trimFlagsMask  = FlagFUA
	zeroFlagsMask  = FlagFUA | FlagNoHole
)

// VolumeFlags describe an export or an open volume.
type VolumeFlags uint32

// Volume flags. Undefined bits are reserved.
const (
	// VolReadOnly: the export can only be opened read-only.
	VolReadOnly VolumeFlags = 1 << iota
	// VolCanTrim: the target accepts Trim.
	VolCanTrim
	// VolCanZero: the target accepts WriteZeroes.
	VolCanZero
	// VolCanFlush: the target has a volatile write-back cache, so Flush and
	// FUA matter.
	VolCanFlush

	volFlagsMask = VolReadOnly | VolCanTrim | VolCanZero | VolCanFlush
)

func (f VolumeFlags) String() string {
	var b strings.Builder
	for i, name := range []string{"read-only", "trim", "zero", "flush"} {
		if f&(1<<i) != 0 {
			if b.Len() > 0 {
				b.WriteByte('|')
			}
			b.WriteString(name)
		}
	}
	if rest := f &^ volFlagsMask; rest != 0 {
		if b.Len() > 0 {
			b.WriteByte('|')
		}
		fmt.Fprintf(&b, "%#x", uint32(rest))
	}
	if b.Len() == 0 {
		return "none"
	}
	return b.String()
}

// Mode is the access mode asked for by Open.
type Mode uint8

// Open modes.
const (
	ModeReadOnly  Mode = 0
	ModeReadWrite Mode = 1
)

func (m Mode) String() string {
	switch m {
	case ModeReadOnly:
		return "read-only"
	case ModeReadWrite:
		return "read-write"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// decodeErr wraps err with the type being decoded.
func decodeErr(t Type, err error) error {
	return fmt.Errorf("decode %v: %w", t, err)
}

// truncated reports a payload of got bytes where want were needed.
func truncated(t Type, got, want int) error {
	return fmt.Errorf("decode %v: %w: %d of %d bytes", t, ErrTruncated, got, want)
}

// fixedSize checks that a payload of a fixed-size message has exactly n bytes.
// (Errors print no length that grows with the input: a fuzzer would take each
// new digit for new coverage.)
func fixedSize(t Type, p []byte, n int) error {
	if len(p) < n {
		return truncated(t, len(p), n)
	}
	if len(p) > n {
		return fmt.Errorf("decode %v: %w: payload of more than %d bytes", t, ErrTrailing, n)
	}
	return nil
}

func checkFlags(what string, flags, mask uint32) error {
	if flags&^mask != 0 {
		return fmt.Errorf("%w: undefined %s flags %#x", ErrReserved, what, flags&^mask)
	}
	return nil
}

func checkReserved(what string, v uint32) error {
	if v != 0 {
		return fmt.Errorf("%w: %s is %#x", ErrReserved, what, v)
	}
	return nil
}

// checkName checks an export name: 1 to MaxNameLen bytes of UTF-8 without NUL.
func checkName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty name", ErrBadField)
	}
	return checkString("name", name)
}

// checkHostID checks a host ID: like a name, but it may be empty.
func checkHostID(id string) error {
	return checkString("host ID", id)
}

// checkString checks that s is at most MaxNameLen bytes of UTF-8 without NUL.
func checkString(what, s string) error {
	switch {
	case len(s) > MaxNameLen:
		return fmt.Errorf("%w: %s of %d bytes, more than %d", ErrBadField, what, len(s), MaxNameLen)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %s %q is not UTF-8", ErrBadField, what, s)
	case strings.IndexByte(s, 0) >= 0:
		return fmt.Errorf("%w: %s %q has a NUL byte", ErrBadField, what, s)
	}
	return nil
}

// checkGeneration checks a session generation, which is never 0.
func checkGeneration(gen uint64) error {
	if gen == 0 {
		return fmt.Errorf("%w: session generation 0", ErrBadField)
	}
	return nil
}

// checkExtent checks that [off, off+length) does not wrap around 2^64.
func checkExtent(off, length uint64) error {
	if off+length < off {
		return fmt.Errorf("%w: range %#x+%#x wraps around", ErrBadField, off, length)
	}
	return nil
}

// Hello is the connection private data, in both directions: the initiator
// sends it with the connect request, the target with its accept. It is
// always framed as version 1, with credits and tag 0.
type Hello struct {
	// MinVersion and MaxVersion are the range of versions the sender
	// speaks, 1 <= MinVersion <= MaxVersion.
	MinVersion uint8
	MaxVersion uint8
	// Features are the optional features the sender supports. Unknown bits
	// are ignored; Negotiate takes the intersection.
	Features uint32
	// RecvCredits is the number of receive buffers the sender posted for
	// its peer before connecting: the peer's initial credits.
	RecvCredits uint16
	// MaxMessage is the largest message (header included) the sender
	// accepts; a peer never sends a larger one.
	MaxMessage uint32
}

func (*Hello) Type() Type { return TypeHello }
func (*Hello) Size() int  { return helloSize }

func (m *Hello) MarshalTo(b []byte) int {
	_ = b[helloSize-1]
	b[0] = m.MinVersion
	b[1] = m.MaxVersion
	be.PutUint16(b[2:], 0)
	be.PutUint32(b[4:], m.Features)
	be.PutUint16(b[8:], m.RecvCredits)
	be.PutUint16(b[10:], 0)
	be.PutUint32(b[12:], m.MaxMessage)
	return helloSize
}

func (m *Hello) Unmarshal(p []byte) error {
	if err := fixedSize(TypeHello, p, helloSize); err != nil {
		return err
	}
	if err := checkReserved("reserved", uint32(be.Uint16(p[2:]))|uint32(be.Uint16(p[10:]))); err != nil {
		return decodeErr(TypeHello, err)
	}
	*m = Hello{
		MinVersion:  p[0],
		MaxVersion:  p[1],
		Features:    be.Uint32(p[4:]),
		RecvCredits: be.Uint16(p[8:]),
		MaxMessage:  be.Uint32(p[12:]),
	}
	if err := m.validate(); err != nil {
		return decodeErr(TypeHello, err)
	}
	return nil
}

func (m *Hello) validate() error {
	if m.MinVersion == 0 || m.MinVersion > m.MaxVersion {
		return fmt.Errorf("%w: versions %d..%d", ErrBadField, m.MinVersion, m.MaxVersion)
	}
	return nil
}

// ErrorMsg is the reply to a request that failed, with the request's tag.
// Err turns it into a *RemoteError; ErrorFor builds one from an error.
type ErrorMsg struct {
	// Code says what failed; it is never 0.
	Code ErrorCode
	// Text is a human-readable detail: UTF-8, at most MaxErrorText bytes.
	Text string
}

func (*ErrorMsg) Type() Type  { return TypeError }
func (m *ErrorMsg) Size() int { return errorFixedSize + len(m.Text) }

func (m *ErrorMsg) MarshalTo(b []byte) int {
	n := m.Size()
	_ = b[n-1]
	be.PutUint32(b[0:], uint32(m.Code))
	be.PutUint16(b[4:], uint16(len(m.Text)))
	copy(b[6:], m.Text)
	return n
}

func (m *ErrorMsg) Unmarshal(p []byte) error {
	if len(p) < errorFixedSize {
		return truncated(TypeError, len(p), errorFixedSize)
	}
	n := int(be.Uint16(p[4:]))
	if n > MaxErrorText {
		return fmt.Errorf("decode %v: %w: text of %d bytes, more than %d", TypeError, ErrBadField, n, MaxErrorText)
	}
	if err := fixedSize(TypeError, p, errorFixedSize+n); err != nil {
		return err
	}
	m.Code = ErrorCode(be.Uint32(p[0:]))
	m.Text = string(p[errorFixedSize:])
	if err := m.validate(); err != nil {
		return decodeErr(TypeError, err)
	}
	return nil
}

func (m *ErrorMsg) validate() error {
	switch {
	case m.Code == 0:
		return fmt.Errorf("%w: error code 0", ErrBadField)
	case len(m.Text) > MaxErrorText:
		return fmt.Errorf("%w: text of %d bytes, more than %d", ErrBadField, len(m.Text), MaxErrorText)
	case !utf8.ValidString(m.Text):
		return fmt.Errorf("%w: text is not UTF-8", ErrBadField)
	}
	return nil
}

// unmarshalEmpty is Unmarshal of the messages without payload.
func unmarshalEmpty(t Type, p []byte) error {
	if len(p) != 0 {
		return fmt.Errorf("decode %v: %w: payload on a message without one", t, ErrTrailing)
	}
	return nil
}

// ListExports asks the target for its exports. It has no payload; the reply
// is ExportList.
type ListExports struct{}

func (*ListExports) Type() Type               { return TypeListExports }
func (*ListExports) Size() int                { return 0 }
func (*ListExports) MarshalTo([]byte) int     { return 0 }
func (*ListExports) Unmarshal(p []byte) error { return unmarshalEmpty(TypeListExports, p) }
func (*ListExports) validate() error          { return nil }

// OK is the success reply, without payload, of Done with DoneFUA, Flush,
// Trim, WriteZeroes, Close and KeepAlive.
type OK struct{}

func (*OK) Type() Type               { return TypeOK }
func (*OK) Size() int                { return 0 }
func (*OK) MarshalTo([]byte) int     { return 0 }
func (*OK) Unmarshal(p []byte) error { return unmarshalEmpty(TypeOK, p) }
func (*OK) validate() error          { return nil }

// Credit has no payload: it only carries credits in its header. A side sends
// it when it owes its peer credits and has nothing else to send (see the
// package doc for when).
type Credit struct{}

func (*Credit) Type() Type               { return TypeCredit }
func (*Credit) Size() int                { return 0 }
func (*Credit) MarshalTo([]byte) int     { return 0 }
func (*Credit) Unmarshal(p []byte) error { return unmarshalEmpty(TypeCredit, p) }
func (*Credit) validate() error          { return nil }

// KeepAlive has no payload. Either side sends it, as a request with a tag of
// its own, when its link has been quiet for a while; the peer replies OK,
// never Error. A side that gets no reply in time takes the link for dead.
type KeepAlive struct{}

func (*KeepAlive) Type() Type               { return TypeKeepAlive }
func (*KeepAlive) Size() int                { return 0 }
func (*KeepAlive) MarshalTo([]byte) int     { return 0 }
func (*KeepAlive) Unmarshal(p []byte) error { return unmarshalEmpty(TypeKeepAlive, p) }
func (*KeepAlive) validate() error          { return nil }

// ExportEntry describes one export in an ExportList.
type ExportEntry struct {
	// Name is what Open takes: 1 to MaxNameLen bytes of UTF-8 without NUL.
	Name string
	// Size is the size of the volume in bytes.
	Size uint64
	// Flags describe the volume.
	Flags VolumeFlags
}

// ExportList is the reply to ListExports. All of it must fit one message.
type ExportList struct {
	Exports []ExportEntry
}

func (m *ExportList) Type() Type      { return TypeExportList }
func (m *ExportList) validate() error { return m.check() }

func (m *ExportList) Size() int {
	n := exportListFixed
	for i := range m.Exports {
		n += exportEntryFixed + len(m.Exports[i].Name)
	}
	return n
}

func (m *ExportList) MarshalTo(b []byte) int {
	be.PutUint16(b[0:], uint16(len(m.Exports)))
	n := exportListFixed
	for i := range m.Exports {
		e := &m.Exports[i]
		b[n] = uint8(len(e.Name))
		n++
		n += copy(b[n:], e.Name)
		be.PutUint64(b[n:], e.Size)
		be.PutUint32(b[n+8:], uint32(e.Flags))
		n += 12
	}
	return n
}

func (m *ExportList) Unmarshal(p []byte) error {
	if len(p) < exportListFixed {
		return truncated(TypeExportList, len(p), exportListFixed)
	}
	if len(p) > MaxPayloadSize {
		return fmt.Errorf("decode %v: %w: payload of more than %d bytes", TypeExportList, ErrTooLarge, MaxPayloadSize)
	}
	count := int(be.Uint16(p))
	r := p[exportListFixed:]
	m.Exports = m.Exports[:0]
	if c := min(count, len(r)/(exportEntryFixed+1)); cap(m.Exports) < c {
		m.Exports = make([]ExportEntry, 0, c)
	}
	for i := 0; i < count; i++ {
		if len(r) < 1 {
			return fmt.Errorf("decode %v: %w: entry %d of %d", TypeExportList, ErrTruncated, i, count)
		}
		l := int(r[0])
		if len(r) < exportEntryFixed+l {
			return fmt.Errorf("decode %v: %w: entry %d of %d", TypeExportList, ErrTruncated, i, count)
		}
		e := ExportEntry{
			Name:  string(r[1 : 1+l]),
			Size:  be.Uint64(r[1+l:]),
			Flags: VolumeFlags(be.Uint32(r[9+l:])),
		}
		if err := e.check(); err != nil {
			return fmt.Errorf("decode %v: entry %d: %w", TypeExportList, i, err)
		}
		m.Exports = append(m.Exports, e)
		r = r[exportEntryFixed+l:]
	}
	if len(r) != 0 {
		return fmt.Errorf("decode %v: %w: %d bytes after %d entries", TypeExportList, ErrTrailing, len(r), count)
	}
	return nil
}

func (e *ExportEntry) check() error {
	if err := checkName(e.Name); err != nil {
		return err
	}
	return checkFlags("volume", uint32(e.Flags), uint32(volFlagsMask))
}

func (m *ExportList) check() error {
	if len(m.Exports) > 0xFFFF {
		return fmt.Errorf("%w: %d exports", ErrTooLarge, len(m.Exports))
	}
	for i := range m.Exports {
		if err := m.Exports[i].check(); err != nil {
			return fmt.Errorf("entry %d: %w", i, err)
		}
	}
	return nil
}

// Open asks the target to open an export; the reply is VolumeInfo.
type Open struct {
	// Mode is ModeReadOnly or ModeReadWrite.
	Mode Mode
	// Name is the export's name.
	Name string
	// HostID is the initiator's stable identity: 0 to MaxNameLen bytes of
	// UTF-8 without NUL. Empty is anonymous: the session cannot be
	// reinstated. With a host ID, the target fences the earlier session
	// of the same host ID and export before it replies when this Open is
	// the same attach coming back (see Instance and the package doc). On a
	// session that named a host ID in AuthStart it is empty or that same
	// ID.
	HostID string
	// Flags: OpenTakeover, OpenInstance.
	Flags uint8
	// Instance names the attach (the initiator process) beside its host
	// ID: random, never 0, the same on every reconnect and queue of the
	// attach. It is on the wire, and not 0, exactly when Flags has
	// OpenInstance; without it Instance is 0.
	Instance uint64
}

// Flags of Open. Undefined bits are reserved.
const (
	// OpenTakeover, on a read-write Open of an exclusive export that
	// another host holds, or that another attach of the same host holds,
	// fences that session and takes the export over instead of failing
	// with ErrBusy.
	OpenTakeover = 1
	// OpenInstance says that the 8-byte Instance follows the fixed part
	// of the Open. Sent only to a target whose Hello offers
	// FeatureOpenInstance.
	OpenInstance = 2

	openFlagsMask = OpenTakeover | OpenInstance
)

func (m *Open) Type() Type { return TypeOpen }
func (m *Open) Size() int  { return openFixedSize + m.instanceLen() + len(m.Name) + len(m.HostID) }

// instanceLen is the bytes Instance takes on the wire.
func (m *Open) instanceLen() int {
	if m.Flags&OpenInstance != 0 {
		return instanceSize
	}
	return 0
}

func (m *Open) MarshalTo(b []byte) int {
	n := m.Size()
	_ = b[n-1]
	b[0] = uint8(m.Mode)
	b[1] = m.Flags
	be.PutUint16(b[2:], uint16(len(m.Name)))
	be.PutUint16(b[4:], uint16(len(m.HostID)))
	be.PutUint16(b[6:], 0)
	o := openFixedSize
	if m.Flags&OpenInstance != 0 {
		be.PutUint64(b[o:], m.Instance)
		o += instanceSize
	}
	o += copy(b[o:], m.Name)
	copy(b[o:], m.HostID)
	return n
}

func (m *Open) Unmarshal(p []byte) error {
	if len(p) < openFixedSize {
		return truncated(TypeOpen, len(p), openFixedSize)
	}
	if err := checkReserved("reserved", uint32(be.Uint16(p[6:]))); err != nil {
		return decodeErr(TypeOpen, err)
	}
	n := int(be.Uint16(p[2:]))
	if n > MaxNameLen {
		return fmt.Errorf("decode %v: %w: name of %d bytes, more than %d", TypeOpen, ErrBadField, n, MaxNameLen)
	}
	h := int(be.Uint16(p[4:]))
	if h > MaxNameLen {
		return fmt.Errorf("decode %v: %w: host ID of %d bytes, more than %d", TypeOpen, ErrBadField, h, MaxNameLen)
	}
	o := openFixedSize
	if p[1]&OpenInstance != 0 {
		o += instanceSize
	}
	if err := fixedSize(TypeOpen, p, o+n+h); err != nil {
		return err
	}
	m.Mode = Mode(p[0])
	m.Flags = p[1]
	m.Instance = 0
	if m.Flags&OpenInstance != 0 {
		m.Instance = be.Uint64(p[openFixedSize:])
	}
	m.Name = string(p[o : o+n])
	m.HostID = string(p[o+n:])
	if err := m.validate(); err != nil {
		return decodeErr(TypeOpen, err)
	}
	return nil
}

func (m *Open) validate() error {
	if m.Mode != ModeReadOnly && m.Mode != ModeReadWrite {
		return fmt.Errorf("%w: mode %d", ErrBadField, m.Mode)
	}
	if err := checkFlags("open", uint32(m.Flags), openFlagsMask); err != nil {
		return err
	}
	if m.Flags&OpenTakeover != 0 && m.Mode != ModeReadWrite {
		return fmt.Errorf("%w: takeover of a read-only open", ErrBadField)
	}
	switch {
	case m.Flags&OpenInstance != 0 && m.Instance == 0:
		return fmt.Errorf("%w: instance 0", ErrBadField)
	case m.Flags&OpenInstance == 0 && m.Instance != 0:
		return fmt.Errorf("%w: instance %#x without the instance flag", ErrBadField, m.Instance)
	}
	if err := checkName(m.Name); err != nil {
		return err
	}
	return checkHostID(m.HostID)
}

// Join adds the connection it is sent on to an open session of the same
// host ID as one more IO queue (as nvme-rdma's IO queues beside its admin
// queue); the reply is VolumeInfo, with a handle of this connection and the
// session's generation. The session is the current one of HostID and the
// export Name whose VolumeInfo gave Generation: a Join of any other
// generation is refused with CodeStale, and a Join is never anonymous. The
// joined connection is fenced with its session: when a later Open of the
// host ID fences the session, every connection that joined it is fenced
// too. Mode is the session's. Flags are reserved.
type Join struct {
	Mode       Mode
	Name       string
	HostID     string
	Generation uint64
}

func (m *Join) Type() Type { return TypeJoin }
func (m *Join) Size() int  { return joinFixedSize + len(m.Name) + len(m.HostID) }

func (m *Join) MarshalTo(b []byte) int {
	n := m.Size()
	_ = b[n-1]
	b[0] = uint8(m.Mode)
	b[1] = 0
	be.PutUint16(b[2:], uint16(len(m.Name)))
	be.PutUint16(b[4:], uint16(len(m.HostID)))
	be.PutUint16(b[6:], 0)
	be.PutUint64(b[8:], m.Generation)
	o := joinFixedSize + copy(b[joinFixedSize:], m.Name)
	copy(b[o:], m.HostID)
	return n
}

func (m *Join) Unmarshal(p []byte) error {
	if len(p) < joinFixedSize {
		return truncated(TypeJoin, len(p), joinFixedSize)
	}
	if err := checkReserved("flags", uint32(p[1])); err != nil {
		return decodeErr(TypeJoin, err)
	}
	if err := checkReserved("reserved", uint32(be.Uint16(p[6:]))); err != nil {
		return decodeErr(TypeJoin, err)
	}
	n := int(be.Uint16(p[2:]))
	if n > MaxNameLen {
		return fmt.Errorf("decode %v: %w: name of %d bytes, more than %d", TypeJoin, ErrBadField, n, MaxNameLen)
	}
	h := int(be.Uint16(p[4:]))
	if h > MaxNameLen {
		return fmt.Errorf("decode %v: %w: host ID of %d bytes, more than %d", TypeJoin, ErrBadField, h, MaxNameLen)
	}
	if err := fixedSize(TypeJoin, p, joinFixedSize+n+h); err != nil {
		return err
	}
	m.Mode = Mode(p[0])
	m.Generation = be.Uint64(p[8:])
	m.Name = string(p[joinFixedSize : joinFixedSize+n])
	m.HostID = string(p[joinFixedSize+n:])
	if err := m.validate(); err != nil {
		return decodeErr(TypeJoin, err)
	}
	return nil
}

func (m *Join) validate() error {
	if m.Mode != ModeReadOnly && m.Mode != ModeReadWrite {
		return fmt.Errorf("%w: mode %d", ErrBadField, m.Mode)
	}
	if err := checkName(m.Name); err != nil {
		return err
	}
	if m.HostID == "" {
		return fmt.Errorf("%w: join without a host ID", ErrBadField)
	}
	if err := checkHostID(m.HostID); err != nil {
		return err
	}
	return checkGeneration(m.Generation)
}

// VolumeInfo is the reply to Open.
type VolumeInfo struct {
	// Handle names the open volume in later requests of this connection.
	Handle uint32
	// Flags describe the volume as opened: VolReadOnly is set for a
	// read-only open too.
	Flags VolumeFlags
	// VolumeSize is the size of the volume in bytes. (The field cannot be
	// called Size: that is the Message method.)
	VolumeSize uint64
	// BlockSize is the logical block size: offsets and lengths of Trim and
	// WriteZeroes are multiples of it.
	BlockSize uint32
	// ChunkSize is the size of the chunks grants are made of; chunk i spans
	// [i*ChunkSize, (i+1)*ChunkSize) of the volume, the last one may be
	// shorter.
	ChunkSize uint32
	// Generation is the session's generation: never 0, unique within the
	// target's lifetime, and higher than that of every earlier session of
	// the same host ID and export. Done and Flush carry it; the target
	// refuses those naming an older generation (CodeStale).
	Generation uint64
	// Instance names the target process: random, the same for every
	// session while it runs, another after a restart. An initiator that
	// reconnects to the same instance knows the target's cache survived
	// (a lost connection then loses no acknowledged write: the target
	// writes back whole chunks a lost session held writable); another
	// instance means writes acknowledged since the last flush may be gone.
	Instance uint64
}

func (m *VolumeInfo) Type() Type { return TypeVolumeInfo }
func (m *VolumeInfo) Size() int  { return volumeInfoSize }
func (m *VolumeInfo) validate() error {
	if err := checkFlags("volume", uint32(m.Flags), uint32(volFlagsMask)); err != nil {
		return err
	}
	return checkGeneration(m.Generation)
}

func (m *VolumeInfo) MarshalTo(b []byte) int {
	_ = b[volumeInfoSize-1]
	be.PutUint32(b[0:], m.Handle)
	be.PutUint32(b[4:], uint32(m.Flags))
	be.PutUint64(b[8:], m.VolumeSize)
	be.PutUint32(b[16:], m.BlockSize)
	be.PutUint32(b[20:], m.ChunkSize)
	be.PutUint64(b[24:], m.Generation)
	be.PutUint64(b[32:], m.Instance)
	return volumeInfoSize
}

func (m *VolumeInfo) Unmarshal(p []byte) error {
	if err := fixedSize(TypeVolumeInfo, p, volumeInfoSize); err != nil {
		return err
	}
	*m = VolumeInfo{
		Handle:     be.Uint32(p[0:]),
		Flags:      VolumeFlags(be.Uint32(p[4:])),
		VolumeSize: be.Uint64(p[8:]),
		BlockSize:  be.Uint32(p[16:]),
		ChunkSize:  be.Uint32(p[20:]),
		Generation: be.Uint64(p[24:]),
		Instance:   be.Uint64(p[32:]),
	}
	if err := m.validate(); err != nil {
		return decodeErr(TypeVolumeInfo, err)
	}
	return nil
}

// GrantRequest asks for a grant of the chunk that holds Offset; the reply is
// Grant.
type GrantRequest struct {
	Handle uint32
	// Flags is GrantWrite if the initiator wants to write the chunk, else 0.
	Flags uint32
	// Offset is any byte offset within the wanted chunk.
	Offset uint64
}

func (m *GrantRequest) Type() Type      { return TypeGrantRequest }
func (m *GrantRequest) Size() int       { return grantRequestSize }
func (m *GrantRequest) validate() error { return checkFlags("grant", m.Flags, grantFlagsMask) }

func (m *GrantRequest) MarshalTo(b []byte) int {
	_ = b[grantRequestSize-1]
	be.PutUint32(b[0:], m.Handle)
	be.PutUint32(b[4:], m.Flags)
	be.PutUint64(b[8:], m.Offset)
	return grantRequestSize
}

func (m *GrantRequest) Unmarshal(p []byte) error {
	if err := fixedSize(TypeGrantRequest, p, grantRequestSize); err != nil {
		return err
	}
	m.Handle = be.Uint32(p[0:])
	m.Flags = be.Uint32(p[4:])
	m.Offset = be.Uint64(p[8:])
	if err := m.validate(); err != nil {
		return decodeErr(TypeGrantRequest, err)
	}
	return nil
}

// Grant lets the initiator reach one chunk with RDMA READ (and RDMA WRITE if
// Flags has GrantWrite) until the target revokes it.
type Grant struct {
	Handle uint32
	// Flags is GrantWrite if the region has remote write access, else 0.
	Flags uint32
	// Offset is the volume offset of the chunk's first byte.
	Offset uint64
	// Addr and RKey name the chunk's registered memory: volume byte
	// Offset+i is at remote address Addr+i.
	Addr uint64
	RKey uint32
	// Length is the size of the chunk in bytes.
	Length uint32
	// Generation tells this grant of the chunk from earlier and later ones;
	// Revoke and RevokeAck name it.
	Generation uint64
}

func (m *Grant) Type() Type      { return TypeGrant }
func (m *Grant) Size() int       { return grantSize }
func (m *Grant) validate() error { return checkFlags("grant", m.Flags, grantFlagsMask) }

func (m *Grant) MarshalTo(b []byte) int {
	_ = b[grantSize-1]
	be.PutUint32(b[0:], m.Handle)
	be.PutUint32(b[4:], m.Flags)
	be.PutUint64(b[8:], m.Offset)
	be.PutUint64(b[16:], m.Addr)
	be.PutUint32(b[24:], m.RKey)
	be.PutUint32(b[28:], m.Length)
	be.PutUint64(b[32:], m.Generation)
	return grantSize
}

func (m *Grant) Unmarshal(p []byte) error {
	if err := fixedSize(TypeGrant, p, grantSize); err != nil {
		return err
	}
	*m = Grant{
		Handle:     be.Uint32(p[0:]),
		Flags:      be.Uint32(p[4:]),
		Offset:     be.Uint64(p[8:]),
		Addr:       be.Uint64(p[16:]),
		RKey:       be.Uint32(p[24:]),
		Length:     be.Uint32(p[28:]),
		Generation: be.Uint64(p[32:]),
	}
	if err := m.validate(); err != nil {
		return decodeErr(TypeGrant, err)
	}
	return nil
}

// Revoke takes a grant back. The target sends it with a tag of its own; the
// initiator replies RevokeAck with the same tag once it no longer uses the
// grant.
type Revoke struct {
	Handle uint32
	// Offset is the chunk's first byte, as in the Grant.
	Offset uint64
	// Generation is the Grant's.
	Generation uint64
}

func (m *Revoke) Type() Type             { return TypeRevoke }
func (m *Revoke) Size() int              { return revokeSize }
func (m *Revoke) validate() error        { return nil }
func (m *Revoke) MarshalTo(b []byte) int { return putRevoke(b, m.Handle, m.Offset, m.Generation) }
func (m *Revoke) Unmarshal(p []byte) error {
	return getRevoke(TypeRevoke, p, &m.Handle, &m.Offset, &m.Generation)
}

// RevokeAck is the initiator's reply to Revoke: it will not use the grant
// again, and it has sent Done for everything it wrote through it.
type RevokeAck struct {
	Handle     uint32
	Offset     uint64
	Generation uint64
}

func (m *RevokeAck) Type() Type             { return TypeRevokeAck }
func (m *RevokeAck) Size() int              { return revokeSize }
func (m *RevokeAck) validate() error        { return nil }
func (m *RevokeAck) MarshalTo(b []byte) int { return putRevoke(b, m.Handle, m.Offset, m.Generation) }
func (m *RevokeAck) Unmarshal(p []byte) error {
	return getRevoke(TypeRevokeAck, p, &m.Handle, &m.Offset, &m.Generation)
}

func putRevoke(b []byte, handle uint32, off, gen uint64) int {
	_ = b[revokeSize-1]
	be.PutUint32(b[0:], handle)
	be.PutUint32(b[4:], 0)
	be.PutUint64(b[8:], off)
	be.PutUint64(b[16:], gen)
	return revokeSize
}

func getRevoke(t Type, p []byte, handle *uint32, off, gen *uint64) error {
	if err := fixedSize(t, p, revokeSize); err != nil {
		return err
	}
	if err := checkReserved("reserved", be.Uint32(p[4:])); err != nil {
		return decodeErr(t, err)
	}
	*handle = be.Uint32(p[0:])
	*off = be.Uint64(p[8:])
	*gen = be.Uint64(p[16:])
	return nil
}

// Range is a byte range of a volume.
type Range struct {
	Offset uint64
	Length uint64
}

// Done tells the target which ranges the initiator wrote with RDMA WRITE.
// Without DoneFUA it has no reply unless it fails; with DoneFUA the reply is
// OK once the ranges are durable.
type Done struct {
	Handle uint32
	// Flags is DoneFUA or 0.
	Flags uint32
	// Generation is the session's, from VolumeInfo; never 0. The target
	// refuses a Done of an older generation with CodeStale.
	Generation uint64
	// Ranges are the written ranges: 1 to MaxDoneRanges of them, none empty.
	Ranges []Range
}

func (m *Done) Type() Type { return TypeDone }
func (m *Done) Size() int  { return doneFixedSize + rangeSize*len(m.Ranges) }

func (m *Done) MarshalTo(b []byte) int {
	n := m.Size()
	_ = b[n-1]
	be.PutUint32(b[0:], m.Handle)
	be.PutUint32(b[4:], m.Flags)
	be.PutUint32(b[8:], uint32(len(m.Ranges)))
	be.PutUint32(b[12:], 0)
	be.PutUint64(b[16:], m.Generation)
	o := b[doneFixedSize:n]
	for _, r := range m.Ranges {
		be.PutUint64(o[0:], r.Offset)
		be.PutUint64(o[8:], r.Length)
		o = o[rangeSize:]
	}
	return n
}

// Unmarshal parses a Done payload into m, reusing m.Ranges: once its
// capacity has grown it does not allocate.
func (m *Done) Unmarshal(p []byte) error {
	if len(p) < doneFixedSize {
		return truncated(TypeDone, len(p), doneFixedSize)
	}
	m.Handle = be.Uint32(p[0:])
	m.Flags = be.Uint32(p[4:])
	count := be.Uint32(p[8:])
	m.Generation = be.Uint64(p[16:])
	if err := checkFlags("done", m.Flags, doneFlagsMask); err != nil {
		return decodeErr(TypeDone, err)
	}
	if err := checkReserved("reserved", be.Uint32(p[12:])); err != nil {
		return decodeErr(TypeDone, err)
	}
	if err := checkGeneration(m.Generation); err != nil {
		return decodeErr(TypeDone, err)
	}
	if count == 0 || count > MaxDoneRanges {
		return fmt.Errorf("decode %v: %w: %d ranges", TypeDone, ErrBadField, count)
	}
	if err := fixedSize(TypeDone, p, doneFixedSize+int(count)*rangeSize); err != nil {
		return err
	}
	if cap(m.Ranges) < int(count) {
		m.Ranges = make([]Range, 0, count)
	}
	m.Ranges = m.Ranges[:count]
	q := p[doneFixedSize:]
	for i := range m.Ranges {
		r := Range{Offset: be.Uint64(q[0:]), Length: be.Uint64(q[8:])}
		if r.Length == 0 || r.Offset+r.Length < r.Offset {
			return fmt.Errorf("decode %v: %w: range %d is %#x+%#x", TypeDone, ErrBadField, i, r.Offset, r.Length)
		}
		m.Ranges[i] = r
		q = q[rangeSize:]
	}
	return nil
}

func (m *Done) validate() error {
	if err := checkFlags("done", m.Flags, doneFlagsMask); err != nil {
		return err
	}
	if err := checkGeneration(m.Generation); err != nil {
		return err
	}
	if len(m.Ranges) == 0 || len(m.Ranges) > MaxDoneRanges {
		return fmt.Errorf("%w: %d ranges", ErrBadField, len(m.Ranges))
	}
	for i, r := range m.Ranges {
		if r.Length == 0 || r.Offset+r.Length < r.Offset {
			return fmt.Errorf("%w: range %d is %#x+%#x", ErrBadField, i, r.Offset, r.Length)
		}
	}
	return nil
}

// Flush asks the target to make durable (written back and fdatasync'd)
// every range of every Done it received before the Flush on this
// connection. The reply is OK.
type Flush struct {
	Handle uint32
	// Generation is the session's, from VolumeInfo; never 0. The target
	// refuses a Flush of an older generation with CodeStale.
	Generation uint64
}

func (m *Flush) Type() Type      { return TypeFlush }
func (m *Flush) Size() int       { return flushSize }
func (m *Flush) validate() error { return checkGeneration(m.Generation) }

func (m *Flush) MarshalTo(b []byte) int {
	_ = b[flushSize-1]
	be.PutUint32(b[0:], m.Handle)
	be.PutUint32(b[4:], 0)
	be.PutUint64(b[8:], m.Generation)
	return flushSize
}

func (m *Flush) Unmarshal(p []byte) error {
	if err := fixedSize(TypeFlush, p, flushSize); err != nil {
		return err
	}
	if err := checkReserved("reserved", be.Uint32(p[4:])); err != nil {
		return decodeErr(TypeFlush, err)
	}
	m.Handle = be.Uint32(p[0:])
	m.Generation = be.Uint64(p[8:])
	if err := m.validate(); err != nil {
		return decodeErr(TypeFlush, err)
	}
	return nil
}

// Close releases a handle and every grant under it. The reply is OK.
type Close struct {
	Handle uint32
}

func (m *Close) Type() Type      { return TypeClose }
func (m *Close) Size() int       { return handleOnlySize }
func (m *Close) validate() error { return nil }

func (m *Close) MarshalTo(b []byte) int {
	_ = b[handleOnlySize-1]
	be.PutUint32(b[0:], m.Handle)
	be.PutUint32(b[4:], 0)
	return handleOnlySize
}

func (m *Close) Unmarshal(p []byte) error {
	if err := fixedSize(TypeClose, p, handleOnlySize); err != nil {
		return err
	}
	if err := checkReserved("reserved", be.Uint32(p[4:])); err != nil {
		return decodeErr(TypeClose, err)
	}
	m.Handle = be.Uint32(p[0:])
	return nil
}

// Trim discards a range: the target punches a hole (fallocate). Reads of it
// return zeroes afterwards. The reply is OK.
type Trim struct {
	Handle uint32
	// Flags is FlagFUA or 0.
	Flags  uint32
	Offset uint64
	Length uint64
}

func (m *Trim) Type() Type             { return TypeTrim }
func (m *Trim) Size() int              { return extentSize }
func (m *Trim) MarshalTo(b []byte) int { return putExtent(b, m.Handle, m.Flags, m.Offset, m.Length) }
func (m *Trim) validate() error        { return checkExtentMsg(m.Flags, trimFlagsMask, m.Offset, m.Length) }
func (m *Trim) Unmarshal(p []byte) error {
	return getExtent(TypeTrim, p, trimFlagsMask, &m.Handle, &m.Flags, &m.Offset, &m.Length)
}

// WriteZeroes zeroes a range with fallocate on the target: a hole is
// punched unless Flags has FlagNoHole. The reply is OK.
type WriteZeroes struct {
	Handle uint32
	// Flags is a combination of FlagFUA and FlagNoHole.
	Flags  uint32
	Offset uint64
	Length uint64
}

func (m *WriteZeroes) Type() Type { return TypeWriteZeroes }
func (m *WriteZeroes) Size() int  { return extentSize }
func (m *WriteZeroes) MarshalTo(b []byte) int {
	return putExtent(b, m.Handle, m.Flags, m.Offset, m.Length)
}
func (m *WriteZeroes) validate() error {
	return checkExtentMsg(m.Flags, zeroFlagsMask, m.Offset, m.Length)
}
func (m *WriteZeroes) Unmarshal(p []byte) error {
	return getExtent(TypeWriteZeroes, p, zeroFlagsMask, &m.Handle, &m.Flags, &m.Offset, &m.Length)
}

func putExtent(b []byte, handle, flags uint32, off, length uint64) int {
	_ = b[extentSize-1]
	be.PutUint32(b[0:], handle)
	be.PutUint32(b[4:], flags)
	be.PutUint64(b[8:], off)
	be.PutUint64(b[16:], length)
	return extentSize
}

func getExtent(t Type, p []byte, mask uint32, handle, flags *uint32, off, length *uint64) error {
	if err := fixedSize(t, p, extentSize); err != nil {
		return err
	}
	*handle = be.Uint32(p[0:])
	*flags = be.Uint32(p[4:])
	*off = be.Uint64(p[8:])
	*length = be.Uint64(p[16:])
	if err := checkExtentMsg(*flags, mask, *off, *length); err != nil {
		return decodeErr(t, err)
	}
	return nil
}

func checkExtentMsg(flags, mask uint32, off, length uint64) error {
	if err := checkFlags("extent", flags, mask); err != nil {
		return err
	}
	return checkExtent(off, length)
}

// Resize is a notice from the target, with tag 0 and no reply: the volume
// open under Handle on this connection grew to VolumeSize bytes. The target
// sends it on every connection that has the volume open (every queue of a
// session), once the new size is in effect there: requests up to it are
// served from then on. A volume never shrinks.
type Resize struct {
	Handle uint32
	// VolumeSize is the volume's new size in bytes, never 0. (The field
	// cannot be called Size: that is the Message method.)
	VolumeSize uint64
}

func (m *Resize) Type() Type { return TypeResize }
func (m *Resize) Size() int  { return resizeSize }
func (m *Resize) validate() error {
	if m.VolumeSize == 0 {
		return fmt.Errorf("%w: volume size 0", ErrBadField)
	}
	return nil
}

func (m *Resize) MarshalTo(b []byte) int {
	_ = b[resizeSize-1]
	be.PutUint32(b[0:], m.Handle)
	be.PutUint32(b[4:], 0)
	be.PutUint64(b[8:], m.VolumeSize)
	return resizeSize
}

func (m *Resize) Unmarshal(p []byte) error {
	if err := fixedSize(TypeResize, p, resizeSize); err != nil {
		return err
	}
	if err := checkReserved("reserved", be.Uint32(p[4:])); err != nil {
		return decodeErr(TypeResize, err)
	}
	m.Handle = be.Uint32(p[0:])
	m.VolumeSize = be.Uint64(p[8:])
	if err := m.validate(); err != nil {
		return decodeErr(TypeResize, err)
	}
	return nil
}
