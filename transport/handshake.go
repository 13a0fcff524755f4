package transport

import "time"

// HandshakeLimiter is implemented by a Listener that reads each new
// stream's connect request itself before Accept returns it (the software
// provider, whose streams are plain TCP until then): streams that connected
// and said nothing yet are invisible to the listener's owner, which bounds
// them through LimitHandshakes. A verbs listener gets connect requests from
// the kernel's connection manager and need not implement it.
type HandshakeLimiter interface {
	// LimitHandshakes replaces the listener's limits on the streams whose
	// connect request it still awaits; it applies to those already
	// waiting as well.
	LimitHandshakes(HandshakeLimits)
}

// HandshakeLimits bound the streams a listener holds before Accept returns
// them.
type HandshakeLimits struct {
	// Timeout is how long a stream may take from its accept (accept(2))
	// until Accept returns its connect request; it is then closed. Zero:
	// the listener's default.
	Timeout time.Duration
	// MaxPending bounds the streams waiting for their connect request (or
	// for Accept to take it). Beyond it a new stream from the peer address
	// that holds the most of them is closed at once; one from another
	// address takes the place of that address's oldest stream, so that a
	// flood from one address cannot keep every other host out. Zero: the
	// listener's default.
	MaxPending int
	// Dropped, if set, is told each stream dropped before its connect
	// request reached Accept (DropTimeout, DropLimit), with the peer's
	// address, before the stream is closed: a peer that sees its stream
	// closed can count on the report. It is called on the listener's
	// goroutines and must not block.
	Dropped func(reason DropReason, remote string)
}

// DropReason says why a listener dropped a stream before its connect
// request reached Accept.
type DropReason int

const (
	// DropTimeout: no connect request within HandshakeLimits.Timeout of
	// the accept.
	DropTimeout DropReason = iota + 1
	// DropLimit: the stream came when MaxPending streams were waiting
	// and its address held the most of them; it was closed at once.
	DropLimit
	// DropEvicted: an older waiting stream made room, within MaxPending,
	// for a stream from an address that held fewer.
	DropEvicted
)

func (r DropReason) String() string {
	switch r {
	case DropTimeout:
		return "timeout"
	case DropLimit:
		return "limit"
	case DropEvicted:
		return "evicted"
	}
	return "unknown"
}

// AcceptTimer is implemented by a ConnRequest that knows when its stream was
// accepted, before its connect request arrived: the owner's handshake
// timeout then runs from that moment, not from Accept's return.
type AcceptTimer interface {
	AcceptedAt() time.Time
}
