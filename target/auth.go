package target

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
)

// Session states of the authentication (see package auth): a session
// serves nothing but AuthStart and AuthResponse until it is ready.
const (
	stateNew        = iota // waiting for AuthStart
	stateChallenged        // AuthChallenge sent, waiting for AuthResponse
	stateReady             // authenticated, or identified on a target without keys
	stateRefused           // refused: closing
)

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

// refuse answers an authentication failure, counts and logs it, and closes
// the session once the answer is sent.
func (s *session) refuse(tag uint64, r *authRefusal) {
	s.mu.Lock()
	already := s.state == stateRefused
	s.state = stateRefused
	host := s.host
	s.mu.Unlock()
	if already {
		return
	}
	s.t.m.authFailures.WithLabelValues(r.reason).Inc()
	s.log.Warn("authentication refused", zap.String("host_id", host), zap.String("reason", r.reason), zap.String("error", r.text))
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		ctx, cancel := context.WithTimeout(s.ctx, time.Second)
		defer cancel()
		if err := s.link.Send(ctx, tag, protocol.ErrorFor(r)); err == nil {
			s.link.WaitSent(ctx)
		}
		s.link.Close()
	}()
}

// authStart answers AuthStart: it names the session's host, checks the
// host's limits and, on a target with keys, challenges it.
func (s *session) authStart(tag uint64, m *protocol.AuthStart) (*opMetrics, error) {
	t := s.t
	keys := t.opts.Auth
	s.mu.Lock()
	if s.state != stateNew {
		s.mu.Unlock()
		s.refuse(tag, &authRefusal{reason: "unauthenticated_request", text: "AuthStart sent twice"})
		return nil, nil
	}
	s.host = m.HostID
	s.mu.Unlock()
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
	}
	if err := t.admitHost(s, m.HostID); err != nil {
		return t.m.opAuth, err
	}
	ct, err := auth.NewChallenge()
	if err != nil {
		return t.m.opAuth, err
	}
	reply := &protocol.AuthChallenge{TargetID: t.opts.TargetID, Challenge: ct}
	s.mu.Lock()
	s.ci, s.ct = m.Challenge, ct
	if keys != nil {
		reply.Flags = protocol.AuthRequired
		s.state = stateChallenged
	} else {
		s.state = stateReady
	}
	s.mu.Unlock()
	if keys == nil {
		s.log.Info("host identified (not authenticated: no --auth-file)", zap.String("host_id", m.HostID))
	}
	s.reply(tag, reply)
	return t.m.opAuth, nil
}

// authResponse checks the initiator's proof and answers with the target's.
func (s *session) authResponse(tag uint64, m *protocol.AuthResponse) (*opMetrics, error) {
	t := s.t
	s.mu.Lock()
	if s.state != stateChallenged {
		s.mu.Unlock()
		s.refuse(tag, &authRefusal{reason: "unauthenticated_request", text: "AuthResponse without a challenge"})
		return nil, nil
	}
	host, ci, ct := s.host, s.ci, s.ct
	s.mu.Unlock()
	secret, _ := t.opts.Auth.Secret(host)
	want := auth.Proof(secret, auth.RoleInitiator, host, t.opts.TargetID, &ci, &ct)
	if !auth.Equal(&want, &m.Proof) {
		s.refuse(tag, &authRefusal{reason: "wrong_secret", text: fmt.Sprintf("wrong secret for host %q", host)})
		return nil, nil
	}
	s.mu.Lock()
	s.state = stateReady
	s.mu.Unlock()
	s.log.Info("host authenticated", zap.String("host_id", host))
	s.reply(tag, &protocol.AuthAccept{Proof: auth.Proof(secret, auth.RoleTarget, host, t.opts.TargetID, &ci, &ct)})
	return t.m.opAuth, nil
}
