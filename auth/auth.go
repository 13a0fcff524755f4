package auth

import (
	"bufio"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/rblk/rblk/internal/safeopen"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
)

// Roles of a proof.
const (
	RoleInitiator = "initiator"
	RoleTarget    = "target"
)

// Limits of a secret, in bytes.
const (
	MinSecret = 16
	MaxSecret = 1024
)

var (
	// ErrFailed matches every authentication failure the initiator sees:
	// a refusal by the target, or a target that did not prove the secret.
	ErrFailed = errors.New("authentication failed")
	// ErrInsecureFile is returned for a secret or key file that group or
	// others may read.
	ErrInsecureFile = errors.New("readable by group or others")
)

// Proof is HMAC-SHA256, keyed with the secret, over a domain label, the
// role, both identities (length-prefixed) and both challenges.
func Proof(secret []byte, role, hostID, targetID string, ci, ct *[protocol.ChallengeSize]byte) [protocol.ChallengeSize]byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("rblk-auth-v1\x00"))
	for _, s := range []string{role, hostID, targetID} {
		var n [2]byte
		binary.BigEndian.PutUint16(n[:], uint16(len(s)))
		m.Write(n[:])
		m.Write([]byte(s))
	}
	m.Write(ci[:])
	m.Write(ct[:])
	var p [protocol.ChallengeSize]byte
	m.Sum(p[:0])
	return p
}

// Equal compares two proofs in constant time.
func Equal(a, b *[protocol.ChallengeSize]byte) bool { return hmac.Equal(a[:], b[:]) }

// NewChallenge returns fresh random bytes.
func NewChallenge() ([protocol.ChallengeSize]byte, error) {
	var c [protocol.ChallengeSize]byte
	if _, err := rand.Read(c[:]); err != nil {
		return c, fmt.Errorf("authentication challenge: %w", err)
	}
	return c, nil
}

// Initiate runs the initiator's side of the exchange on a new link, before
// any other request. With a nil secret it only names the host (hostID may
// then be empty), and fails if the target requires authentication. It
// returns the target's ID. Every failure matches ErrFailed and says
// "authentication"; the caller closes the link.
func Initiate(ctx context.Context, l *link.Link, hostID string, secret []byte) (string, error) {
	start := protocol.AuthStart{HostID: hostID}
	if secret != nil {
		start.Flags = protocol.AuthHaveSecret
		if hostID == "" {
			return "", fmt.Errorf("%w: a secret needs a host ID", ErrFailed)
		}
	}
	var err error
	if start.Challenge, err = NewChallenge(); err != nil {
		return "", err
	}
	var ch protocol.AuthChallenge
	if err := l.Request(ctx, &start, &ch); err != nil {
		return "", refused(err)
	}
	switch {
	case ch.Flags&protocol.AuthRequired == 0 && secret != nil:
		return "", fmt.Errorf("%w: target %q does not authenticate (rblkd runs without --auth-file), so it cannot prove it knows host %q's secret; refusing it",
			ErrFailed, ch.TargetID, hostID)
	case ch.Flags&protocol.AuthRequired == 0:
		return ch.TargetID, nil
	case secret == nil:
		return "", fmt.Errorf("%w: target %q requires a secret for host %q (--secret-file)", ErrFailed, ch.TargetID, hostID)
	}
	resp := protocol.AuthResponse{Proof: Proof(secret, RoleInitiator, hostID, ch.TargetID, &start.Challenge, &ch.Challenge)}
	var acc protocol.AuthAccept
	if err := l.Request(ctx, &resp, &acc); err != nil {
		return "", refused(err)
	}
	want := Proof(secret, RoleTarget, hostID, ch.TargetID, &start.Challenge, &ch.Challenge)
	if !Equal(&want, &acc.Proof) {
		return "", fmt.Errorf("%w: target %q did not prove it knows host %q's secret", ErrFailed, ch.TargetID, hostID)
	}
	return ch.TargetID, nil
}

// refused wraps the target's refusal (or a failed request) of the exchange.
func refused(err error) error {
	var re *protocol.RemoteError
	if errors.As(err, &re) && re.Code == protocol.CodeAccess {
		return fmt.Errorf("%w: the target refused: %s", ErrFailed, strings.TrimPrefix(re.Text, "authentication: "))
	}
	return fmt.Errorf("authentication: %w", err)
}

// Keys are the target's secrets by host ID.
type Keys struct {
	secrets map[string][]byte
}

// NewKeys builds Keys from a map of host ID to secret (for tests and
// embedding); secrets are checked as in LoadKeys.
func NewKeys(secrets map[string][]byte) (*Keys, error) {
	k := &Keys{secrets: make(map[string][]byte, len(secrets))}
	for h, s := range secrets {
		if err := checkSecret(s); err != nil {
			return nil, fmt.Errorf("secret of host %q: %w", h, err)
		}
		k.secrets[h] = bytes.Clone(s)
	}
	return k, nil
}

// Secret returns the secret of hostID.
func (k *Keys) Secret(hostID string) ([]byte, bool) {
	s, ok := k.secrets[hostID]
	return s, ok
}

// Len is the number of hosts.
func (k *Keys) Len() int { return len(k.secrets) }

// LoadKeys reads an auth file: one host per line, "HOST-ID SECRET",
// separated by blanks; empty lines and lines starting with '#' are
// skipped. The file must not be readable by group or others.
func LoadKeys(path string) (*Keys, error) {
	b, err := readPrivate(path, "auth file")
	if err != nil {
		return nil, err
	}
	k := &Keys{secrets: make(map[string][]byte)}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			// Never quote the line: it holds a secret.
			return nil, fmt.Errorf("auth file %s line %d: want \"HOST-ID SECRET\", got %d fields", path, n, len(f))
		}
		if len(f[0]) > protocol.MaxNameLen {
			return nil, fmt.Errorf("auth file %s line %d: host ID longer than %d bytes", path, n, protocol.MaxNameLen)
		}
		if _, dup := k.secrets[f[0]]; dup {
			return nil, fmt.Errorf("auth file %s line %d: host %q given twice", path, n, f[0])
		}
		if err := checkSecret([]byte(f[1])); err != nil {
			return nil, fmt.Errorf("auth file %s line %d (host %q): %w", path, n, f[0], err)
		}
		k.secrets[f[0]] = []byte(f[1])
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("auth file %s: %w", path, err)
	}
	if len(k.secrets) == 0 {
		return nil, fmt.Errorf("auth file %s: no hosts", path)
	}
	return k, nil
}

// ReadSecret reads an initiator's secret file: the secret on one line
// (surrounding blanks and the newline are dropped). The file must not be
// readable by group or others.
func ReadSecret(path string) ([]byte, error) {
	b, err := readPrivate(path, "secret file")
	if err != nil {
		return nil, err
	}
	s := bytes.TrimSpace(b)
	if bytes.ContainsAny(s, " \t\r\n") {
		return nil, fmt.Errorf("secret file %s: the secret must be one word on one line", path)
	}
	if err := checkSecret(s); err != nil {
		return nil, fmt.Errorf("secret file %s: %w", path, err)
	}
	return s, nil
}

func checkSecret(s []byte) error {
	if len(s) < MinSecret || len(s) > MaxSecret {
		return fmt.Errorf("secret of %d bytes: want %d to %d (for example: openssl rand -hex 32)", len(s), MinSecret, MaxSecret)
	}
	return nil
}

// readPrivate reads a file that only its owner may read. Anything but a
// regular file (a FIFO, a socket, a device) is refused at once, never
// waited on (see package safeopen).
func readPrivate(path, what string) ([]byte, error) {
	b, fi, err := safeopen.ReadFile(path, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		clear(b)
		return nil, fmt.Errorf("%s %s has mode %#o, %w: run chmod 600 %s", what, path, perm, ErrInsecureFile, path)
	}
	return b, nil
}
