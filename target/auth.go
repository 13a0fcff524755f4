package target

import (
	"context"
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
)

// Session states of the authentication (see package auth): a session
// serves nothing but AuthStart and AuthResponse until it is ready. Each
// step moves the state under the session's lock before anything else, so
// that one AuthStart and one AuthResponse are served per connection,
// however the goroutines that serve them interleave: a second one finds
// the state moved and ends the session.
const (
	stateNew        = iota // waiting for AuthStart
	stateStarting          // AuthStart being answered
	stateChallenged        // AuthChallenge sent, waiting for AuthResponse
	stateProving           // AuthResponse being checked
	stateReady             // authenticated, or identified on a target without keys
	stateRefused           // refused: closing
)

// maxFailKeys bounds the peer addresses and host IDs whose failed
// authentications are counted (see buckets).
const maxFailKeys = 4096

// authRefusal is a refused authentication: the reply's text, the metric's
// reason and the log's line.
type authRefusal struct {
	reason string
	text   string
}

func (e *authRefusal) Error() string { return "authentication: " + e.text }
func (e *authRefusal) Unwrap() error { return protocol.ErrAccess }

// gate decides, on the completion goroutine, whether a message may be
// served in the session's state; a request before authentication is
// refused and ends the session.
func (s *session) gate(h protocol.Header) bool {
	s.mu.Lock()
	st := s.state
	s.mu.Unlock()
	if st == stateReady || h.Type == protocol.TypeAuthStart || h.Type == protocol.TypeAuthResponse {
		return true
	}
	if st == stateRefused {
		return false
	}
	s.refuse(h.Tag, &authRefusal{reason: "unauthenticated_request",
		text: fmt.Sprintf("%v before authentication: send AuthStart first", h.Type)})
	return false
}

// refuse answers an authentication failure, counts it (against the peer's
// address too, see Options.FailedAuthPerPeer) and logs it, and closes the
// session once the answer is sent.
func (s *session) refuse(tag uint64, r *authRefusal) {
	s.mu.Lock()
	host := s.host
	s.mu.Unlock()
	if !s.markRefused() {
		return
	}
	// Counted before the answer leaves: whoever got it sees the count.
	s.t.m.authFailures.WithLabelValues(r.reason).Inc()
	if r.reason != "rate_limited" {
		s.t.authMu.Lock()
		s.t.peerFails.take(s.peer, time.Now())
		s.t.authMu.Unlock()
	}
	s.noisy.Warn("authentication refused", zap.String("host_id", host), zap.String("reason", r.reason), zap.String("error", r.text))
	s.answerAndClose(tag, r)
}

// markRefused moves the session to stateRefused; false if it was already.
func (s *session) markRefused() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	already := s.state == stateRefused
	s.state = stateRefused
	return !already
}

// answerAndClose answers tag with err and closes the session once the
// answer is sent.
func (s *session) answerAndClose(tag uint64, err error) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		ctx, cancel := context.WithTimeout(s.ctx, time.Second)
		defer cancel()
		if err := s.link.Send(ctx, tag, protocol.ErrorFor(err)); err == nil {
			s.link.WaitSent(ctx)
		}
		s.link.Close()
	}()
}

// endAuth ends the session on an error of its authentication that is not
// the initiator's fault (a session limit, a failure of the target): it is
// answered with err, which says why, and counted as a failed auth request.
func (s *session) endAuth(tag uint64, err error) {
	if !s.markRefused() {
		return
	}
	op := s.t.m.opAuth
	op.failed.Inc()
	op.errors.Inc()
	s.noisy.Warn("session refused", zap.String("host_id", s.hostID()), zap.Error(err))
	s.answerAndClose(tag, err)
}

// peerName is the session's peer address for messages.
func (s *session) peerName() string { return strings.TrimPrefix(s.peer, "peer:") }

// authStart answers AuthStart: it names the session's host and, on a
// target with keys, challenges it; on a target without, the host is
// identified and counted against its limits now.
func (s *session) authStart(tag uint64, m *protocol.AuthStart) (*opMetrics, error) {
	t := s.t
	keys := t.opts.Auth
	s.mu.Lock()
	if s.state != stateNew {
		s.mu.Unlock()
		s.refuse(tag, &authRefusal{reason: "unauthenticated_request", text: "AuthStart sent twice"})
		return nil, nil
	}
	s.state = stateStarting
	s.host = m.HostID
	s.mu.Unlock()
	t.authMu.Lock()
	wait := t.peerFails.wait(s.peer, time.Now())
	t.authMu.Unlock()
	if wait > 0 {
		t.m.authLimited.WithLabelValues("peer").Inc()
		s.refuse(tag, &authRefusal{reason: "rate_limited", text: fmt.Sprintf("too many failed authentications from %s: retry in %v",
			s.peerName(), wait.Round(100*time.Millisecond)+100*time.Millisecond)})
		return nil, nil
	}
	if keys != nil {
		if m.HostID == "" {
			s.refuse(tag, &authRefusal{reason: "unknown_host", text: "no host ID given; this target authenticates every host"})
			return nil, nil
		}
		if _, ok := keys.Secret(m.HostID); !ok {
			s.refuse(tag, &authRefusal{reason: "unknown_host", text: fmt.Sprintf("unknown host %q (not in the target's auth file)", m.HostID)})
			return nil, nil
		}
		if m.Flags&protocol.AuthHaveSecret == 0 {
			s.refuse(tag, &authRefusal{reason: "no_secret", text: fmt.Sprintf("host %q gave no secret; this target requires one (rblk-attach --secret-file)", m.HostID)})
			return nil, nil
		}
	} else if err := t.admitHost(s, m.HostID); err != nil {
		s.endAuth(tag, err)
		return nil, nil
	}
	ct, err := auth.NewChallenge()
	if err != nil {
		s.endAuth(tag, err)
		return nil, nil
	}
	reply := &protocol.AuthChallenge{TargetID: t.opts.TargetID, Challenge: ct}
	s.mu.Lock()
	if s.state != stateStarting {
		// Refused meanwhile (a second AuthStart, the handshake timeout).
		s.mu.Unlock()
		return nil, nil
	}
	s.ci, s.ct = m.Challenge, ct
	if keys != nil {
		reply.Flags = protocol.AuthRequired
		s.state = stateChallenged
	} else {
		s.state = stateReady
	}
	s.mu.Unlock()
	if keys == nil {
		s.noisy.Info("host identified (not authenticated: no --auth-file)", zap.String("host_id", m.HostID))
	}
	s.reply(tag, reply)
	return t.m.opAuth, nil
}

// authResponse checks the initiator's proof and answers with the target's.
// A right proof counts the session against its host's limits; a wrong one
// for a host that had too many lately is answered late (see
// Options.FailedAuthPerHost).
func (s *session) authResponse(tag uint64, m *protocol.AuthResponse) (*opMetrics, error) {
	t := s.t
	s.mu.Lock()
	if s.state != stateChallenged {
		s.mu.Unlock()
		s.refuse(tag, &authRefusal{reason: "unauthenticated_request", text: "AuthResponse without a challenge"})
		return nil, nil
	}
	s.state = stateProving
	host, ci, ct := s.host, s.ci, s.ct
	s.mu.Unlock()
	secret, _ := t.opts.Auth.Secret(host)
	want := auth.Proof(secret, auth.RoleInitiator, host, t.opts.TargetID, &ci, &ct)
	if !auth.Equal(&want, &m.Proof) {
		t.authMu.Lock()
		late := !t.hostFails.take(host, time.Now())
		t.authMu.Unlock()
		text := fmt.Sprintf("wrong secret for host %q", host)
		if late {
			t.m.authLimited.WithLabelValues("host").Inc()
			text += " (answered late: too many wrong secrets for this host lately)"
			delay := time.NewTimer(min(failedAuthDelay, time.Until(s.pre.since.Add(t.opts.HandshakeTimeout))))
			select {
			case <-delay.C:
			case <-s.ctx.Done():
			}
			delay.Stop()
		}
		s.refuse(tag, &authRefusal{reason: "wrong_secret", text: text})
		return nil, nil
	}
	if err := t.admitHost(s, host); err != nil {
		s.endAuth(tag, err)
		return nil, nil
	}
	s.mu.Lock()
	if s.state != stateProving {
		// Refused meanwhile (the handshake timeout): counted, and the
		// session's end gives it back.
		s.mu.Unlock()
		return nil, nil
	}
	s.state = stateReady
	s.mu.Unlock()
	s.noisy.Info("host authenticated", zap.String("host_id", host))
	s.reply(tag, &protocol.AuthAccept{Proof: auth.Proof(secret, auth.RoleTarget, host, t.opts.TargetID, &ci, &ct)})
	return t.m.opAuth, nil
}
