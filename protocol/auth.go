package protocol

import "fmt"

// ChallengeSize is the size of an authentication challenge and of a proof
// (an HMAC-SHA256).
const ChallengeSize = 32

// Payload sizes of the fixed parts of the authentication messages.
const (
	authStartFixed     = 8 + ChallengeSize
	authChallengeFixed = 8 + ChallengeSize
	authProofSize      = ChallengeSize
)

// Flags of AuthStart and AuthChallenge. Undefined bits are reserved.
const (
	// AuthHaveSecret, in AuthStart, says the initiator has a secret and
	// will prove it: it refuses a target that does not authenticate.
	AuthHaveSecret = 1
	// AuthRequired, in AuthChallenge, says the target authenticates: the
	// initiator must answer with AuthResponse before anything else.
	AuthRequired = 1

	authStartFlagsMask     = AuthHaveSecret
	authChallengeFlagsMask = AuthRequired
)

// AuthStart is the first request of every session: it names the initiator
// and brings its random challenge. The reply is AuthChallenge, or an Error
// with CodeAccess (unknown host, missing secret).
type AuthStart struct {
	// Flags: AuthHaveSecret.
	Flags uint8
	// HostID is the initiator's identity (see Open.HostID); empty is
	// anonymous, which a target that authenticates refuses.
	HostID string
	// Challenge is ChallengeSize fresh random bytes.
	Challenge [ChallengeSize]byte
}

func (*AuthStart) Type() Type  { return TypeAuthStart }
func (m *AuthStart) Size() int { return authStartFixed + len(m.HostID) }

func (m *AuthStart) MarshalTo(b []byte) int {
	return putAuthHello(b, m.Flags, m.HostID, &m.Challenge)
}

func (m *AuthStart) Unmarshal(p []byte) error {
	id, err := getAuthHello(TypeAuthStart, p, &m.Flags, &m.Challenge, "host ID")
	if err != nil {
		return err
	}
	m.HostID = id
	if err := m.validate(); err != nil {
		return decodeErr(TypeAuthStart, err)
	}
	return nil
}

func (m *AuthStart) validate() error {
	if err := checkFlags("auth start", uint32(m.Flags), authStartFlagsMask); err != nil {
		return err
	}
	return checkHostID(m.HostID)
}

// AuthChallenge is the target's reply to AuthStart: its identity, whether
// it authenticates, and its random challenge.
type AuthChallenge struct {
	// Flags: AuthRequired.
	Flags uint8
	// TargetID names the target; both proofs cover it.
	TargetID string
	// Challenge is ChallengeSize fresh random bytes.
	Challenge [ChallengeSize]byte
}

func (*AuthChallenge) Type() Type  { return TypeAuthChallenge }
func (m *AuthChallenge) Size() int { return authChallengeFixed + len(m.TargetID) }

func (m *AuthChallenge) MarshalTo(b []byte) int {
	return putAuthHello(b, m.Flags, m.TargetID, &m.Challenge)
}

func (m *AuthChallenge) Unmarshal(p []byte) error {
	id, err := getAuthHello(TypeAuthChallenge, p, &m.Flags, &m.Challenge, "target ID")
	if err != nil {
		return err
	}
	m.TargetID = id
	if err := m.validate(); err != nil {
		return decodeErr(TypeAuthChallenge, err)
	}
	return nil
}

func (m *AuthChallenge) validate() error {
	if err := checkFlags("auth challenge", uint32(m.Flags), authChallengeFlagsMask); err != nil {
		return err
	}
	return checkString("target ID", m.TargetID)
}

// putAuthHello writes the common layout of AuthStart and AuthChallenge:
// flags, reserved byte, identity length, reserved word, challenge, identity.
func putAuthHello(b []byte, flags uint8, id string, ch *[ChallengeSize]byte) int {
	n := authStartFixed + len(id)
	_ = b[n-1]
	b[0] = flags
	b[1] = 0
	be.PutUint16(b[2:], uint16(len(id)))
	be.PutUint32(b[4:], 0)
	copy(b[8:], ch[:])
	copy(b[authStartFixed:], id)
	return n
}

func getAuthHello(t Type, p []byte, flags *uint8, ch *[ChallengeSize]byte, what string) (string, error) {
	if len(p) < authStartFixed {
		return "", truncated(t, len(p), authStartFixed)
	}
	if err := checkReserved("reserved", uint32(p[1])|be.Uint32(p[4:])); err != nil {
		return "", decodeErr(t, err)
	}
	n := int(be.Uint16(p[2:]))
	if n > MaxNameLen {
		return "", fmt.Errorf("decode %v: %w: %s of %d bytes, more than %d", t, ErrBadField, what, n, MaxNameLen)
	}
	if err := fixedSize(t, p, authStartFixed+n); err != nil {
		return "", err
	}
	*flags = p[0]
	copy(ch[:], p[8:authStartFixed])
	return string(p[authStartFixed:]), nil
}

// AuthResponse is the initiator's proof that it knows its secret, sent
// after AuthChallenge said AuthRequired. The reply is AuthAccept, or an
// Error with CodeAccess after which the target closes the connection.
type AuthResponse struct {
	Proof [ChallengeSize]byte
}

func (*AuthResponse) Type() Type                 { return TypeAuthResponse }
func (*AuthResponse) Size() int                  { return authProofSize }
func (m *AuthResponse) MarshalTo(b []byte) int   { return copy(b[:authProofSize], m.Proof[:]) }
func (m *AuthResponse) Unmarshal(p []byte) error { return getProof(TypeAuthResponse, p, &m.Proof) }
func (*AuthResponse) validate() error            { return nil }

// AuthAccept is the target's reply to a good AuthResponse: its own proof,
// which the initiator checks before it trusts the target.
type AuthAccept struct {
	Proof [ChallengeSize]byte
}

func (*AuthAccept) Type() Type                 { return TypeAuthAccept }
func (*AuthAccept) Size() int                  { return authProofSize }
func (m *AuthAccept) MarshalTo(b []byte) int   { return copy(b[:authProofSize], m.Proof[:]) }
func (m *AuthAccept) Unmarshal(p []byte) error { return getProof(TypeAuthAccept, p, &m.Proof) }
func (*AuthAccept) validate() error            { return nil }

func getProof(t Type, p []byte, proof *[ChallengeSize]byte) error {
	if err := fixedSize(t, p, authProofSize); err != nil {
		return err
	}
	copy(proof[:], p)
	return nil
}
