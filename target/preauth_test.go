package target_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/faultproxy"
	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/tcp"
)

// These tests play hostile clients before authentication (see
// Options.MaxUnauthenticated, MaxSessionsPerHost, FailedAuthPerPeer and
// FailedAuthPerHost). Attackers dial from other loopback addresses than
// the real host (127.0.0.1): the target tells peers apart by address.

// needTCP skips tests that dial from several addresses or speak raw TCP:
// the software transport's.
func needTCP(t *testing.T) {
	t.Helper()
	if os.Getenv("RBLK_TARGET_TRANSPORT") == "rdma" {
		t.Skip("dials from several loopback addresses: software transport only")
	}
}

// dialFrom opens a link to e from the loopback address local, without
// authenticating.
func (e *env) dialFrom(local string) (*link.Link, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p := tcp.NewWithOptions("tcp", tcp.Options{LocalAddr: local + ":0"})
	l, err := link.Dial(ctx, p, e.addr, link.Options{Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		return nil, err
	}
	e.t.Cleanup(func() { l.Close() })
	return l, nil
}

// connectFrom is connect from the loopback address local.
func (e *env) connectFrom(local, host string, secret []byte) (*link.Link, error) {
	l, err := e.dialFrom(local)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := auth.Initiate(ctx, l, host, secret); err != nil {
		l.Close()
		return l, err
	}
	return l, nil
}

// authStart sends an AuthStart for host (claiming a secret) on l.
func authStart(l *link.Link, host string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m := &protocol.AuthStart{Flags: protocol.AuthHaveSecret, HostID: host}
	return l.Request(ctx, m, &protocol.AuthChallenge{})
}

// gauge is the value of the unlabelled gauge or counter name.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	v, _ := metricstest.Sum(t, reg, name)
	return v
}

// eventually polls cond until it holds or 10 seconds passed.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestAuthStartOncePerConnection: AuthStart sent again on a connection,
// after its challenge or at once in parallel, ends that connection and
// counts nothing against the host: afterwards the real host gets all its
// sessions. On a target without keys too, where the host is counted when
// it names itself.
func TestAuthStartOncePerConnection(t *testing.T) {
	for _, keys := range []bool{true, false} {
		t.Run(fmt.Sprintf("keys=%v", keys), func(t *testing.T) {
			needTCP(t) // (the attacker dials from 127.0.0.2)
			opts := target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, MaxSessionsPerHost: 2}
			secret := []byte(nil)
			if keys {
				opts.Auth, secret = testKeys(t), secretA
			}
			e, reg := startWith(t, make([]byte, 256<<10), opts, target.ExportConfig{Shared: true})
			for i := range 100 {
				l, err := e.dialFrom("127.0.0.2")
				if err != nil {
					t.Fatal(err)
				}
				if i < 2 {
					// In turn: the second is refused and ends the session.
					if err := authStart(l, "host-a"); err != nil {
						t.Fatalf("first AuthStart: %v", err)
					}
					err := authStart(l, "host-a")
					if !errors.Is(err, protocol.ErrAccess) || !strings.Contains(err.Error(), "AuthStart sent twice") {
						t.Fatalf("second AuthStart: %v, want it refused", err)
					}
				} else {
					// At once: whatever the interleaving, at most one
					// gets a challenge.
					var wg sync.WaitGroup
					var mu sync.Mutex
					ok := 0
					for range 32 {
						wg.Add(1)
						go func() {
							defer wg.Done()
							if authStart(l, "host-a") == nil {
								mu.Lock()
								ok++
								mu.Unlock()
							}
						}()
					}
					wg.Wait()
					if ok > 1 {
						t.Fatalf("%d AuthStarts on one connection got a challenge", ok)
					}
				}
				waitDown(t, l, "a connection that sent AuthStart twice")
			}
			eventually(t, "the refused sessions end", func() bool { return gauge(t, reg, "rblkd_sessions") == 0 })
			if v, ok := seriesBy(t, reg, "rblkd_host_sessions", "host_id", "host-a"); ok {
				t.Fatalf("rblkd_host_sessions{host_id=\"host-a\"} = %v with no session left", v)
			}
			// The real host gets its two sessions, and no third.
			for i := range 2 {
				if _, err := e.connect("host-a", secret); err != nil {
					t.Fatalf("real host's session %d: %v", i+1, err)
				}
			}
			if _, err := e.connect("host-a", secret); !errors.Is(err, protocol.ErrBusy) {
				t.Fatalf("real host's third session: %v, want busy", err)
			}
		})
	}
}

// TestUnprovenSessionsDoNotCount: connections that named a host and never
// proved its secret do not count against it; only proven ones do.
func TestUnprovenSessionsDoNotCount(t *testing.T) {
	e, reg := startWith(t, make([]byte, 256<<10), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Auth: testKeys(t),
		MaxSessionsPerHost: 2}, target.ExportConfig{Shared: true})
	for range 4 {
		l, err := e.dial2("127.0.0.2")
		if err != nil {
			t.Fatal(err)
		}
		if err := authStart(l, "host-a"); err != nil {
			t.Fatal(err)
		}
	}
	if v := gauge(t, reg, "rblkd_sessions_unauthenticated"); v != 4 {
		t.Fatalf("rblkd_sessions_unauthenticated = %v with four challenged connections, want 4", v)
	}
	for i := range 2 {
		if _, err := e.connect("host-a", secretA); err != nil {
			t.Fatalf("real host's session %d beside four unproven ones: %v", i+1, err)
		}
	}
	if v := labeled(t, reg, "rblkd_host_sessions", "host_id", "host-a"); v != 2 {
		t.Fatalf("rblkd_host_sessions{host_id=\"host-a\"} = %v, want 2 (the proven ones)", v)
	}
	if _, err := e.connect("host-a", secretA); !errors.Is(err, protocol.ErrBusy) || !strings.Contains(err.Error(), `host "host-a" has 2 sessions`) {
		t.Fatalf("a third proven session: %v, want busy", err)
	}
}

// dial2 is dialFrom, skipped on other transports.
func (e *env) dial2(local string) (*link.Link, error) {
	needTCP(e.t)
	return e.dialFrom(local)
}

// TestUnauthenticatedLimit: connections that do not authenticate are
// bounded apart from the sessions: beyond MaxUnauthenticated a new one
// from the address that holds them is refused at once, busy, saying why;
// the real host still gets in (one of the flood's is closed for it), and
// silent connections never take the place of authenticated sessions.
func TestUnauthenticatedLimit(t *testing.T) {
	e, reg := startWith(t, make([]byte, 256<<10), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Auth: testKeys(t),
		MaxUnauthenticated: 4, MaxSessions: 2}, target.ExportConfig{Shared: true})
	var silent []*link.Link
	for range 4 {
		l, err := e.dial2("127.0.0.2")
		if err != nil {
			t.Fatal(err)
		}
		silent = append(silent, l)
	}
	for range 3 {
		_, err := e.dialFrom("127.0.0.2")
		if !errors.Is(err, protocol.ErrBusy) || !strings.Contains(err.Error(), "too many connections waiting to authenticate (limit 4, 4 from your address)") {
			t.Fatalf("a fifth silent connection: %v, want it refused busy", err)
		}
	}
	if v := labeled(t, reg, "rblkd_refused_total", "reason", "unauthenticated_limit"); v != 3 {
		t.Fatalf("rblkd_refused_total{reason=\"unauthenticated_limit\"} = %v, want 3", v)
	}
	// The real host, from another address, gets in while they wait: the
	// oldest silent connection is closed for it.
	if _, err := e.connect("host-a", secretA); err != nil {
		t.Fatalf("real host beside a full limit of silent connections: %v", err)
	}
	waitDown(t, silent[0], "the oldest silent connection")
	if v := labeled(t, reg, "rblkd_refused_total", "reason", "unauthenticated_evicted"); v != 1 {
		t.Fatalf("rblkd_refused_total{reason=\"unauthenticated_evicted\"} = %v, want 1", v)
	}
	eventually(t, "rblkd_sessions_unauthenticated = 3", func() bool { return gauge(t, reg, "rblkd_sessions_unauthenticated") == 3 })
	// MaxSessions is 2: the silent connections took none of it.
	if _, err := e.connect("host-b", secretB); err != nil {
		t.Fatalf("second real session beside three silent connections: %v", err)
	}
	for _, l := range silent[1:] {
		select {
		case <-l.Done():
			t.Fatal("a silent connection was closed that did not have to be")
		default:
		}
	}
	// MaxSessions authenticated: the next connection is refused at once.
	if _, err := e.connect("host-a", secretA); !errors.Is(err, protocol.ErrBusy) || !strings.Contains(err.Error(), "too many sessions on the target (limit 2)") {
		t.Fatalf("a third session: %v, want busy", err)
	}
}

// TestSilentStreamsBoundedFromAccept: TCP streams that send nothing at
// all (not even the transport's connect request) are bounded too: beyond
// MaxUnauthenticated, a new one from the flood's address is closed at once;
// every one is closed within HandshakeTimeout of its accept, not the
// transport's own 10 s; the real host gets in meanwhile; all counted.
func TestSilentStreamsBoundedFromAccept(t *testing.T) {
	needTCP(t)
	const timeout = time.Second
	e, reg := startWith(t, make([]byte, 256<<10), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Auth: testKeys(t),
		MaxUnauthenticated: 4, HandshakeTimeout: timeout}, target.ExportConfig{Shared: true})
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	type stream struct {
		nc     net.Conn
		dialed time.Time
		closed chan time.Time
	}
	watch := func() *stream {
		start := time.Now()
		nc, err := d.Dial("tcp", e.addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { nc.Close() })
		s := &stream{nc: nc, dialed: start, closed: make(chan time.Time, 1)}
		go func() {
			nc.SetReadDeadline(time.Now().Add(20 * time.Second))
			_, err := io.Copy(io.Discard, nc) // returns at the target's close
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return
			}
			s.closed <- time.Now()
		}()
		return s
	}
	// closedBy waits for s to be closed, at the latest by.
	closedBy := func(s *stream, by time.Time, what string) {
		t.Helper()
		select {
		case at := <-s.closed:
			if at.After(by) {
				t.Errorf("%s closed %v after its dial, want at most %v", what, at.Sub(s.dialed), by.Sub(s.dialed))
			}
		case <-time.After(time.Until(by) + 20*time.Second):
			t.Fatalf("%s still open %v after its dial", what, time.Since(s.dialed))
		}
	}
	var held []*stream
	for range 4 {
		held = append(held, watch())
	}
	// The listener holds four: it has accepted them once a fifth finds
	// the bound full. Those beyond are closed at once.
	var extra []*stream
	for range 6 {
		extra = append(extra, watch())
	}
	for i, s := range extra {
		// At once: long before any handshake timeout could close it.
		closedBy(s, s.dialed.Add(timeout/2), fmt.Sprintf("silent stream %d beyond the limit", i+5))
	}
	// The real host gets in while they wait (the oldest gives way).
	if _, err := e.connect("host-a", secretA); err != nil {
		t.Fatalf("real host beside a full limit of silent streams: %v", err)
	}
	// Every silent stream is closed within the handshake timeout of its
	// accept (slack for a loaded machine; the transport's own timeout is
	// 10 s).
	for i, s := range held {
		closedBy(s, s.dialed.Add(2*timeout), fmt.Sprintf("silent stream %d", i+1))
	}
	if v := labeled(t, reg, "rblkd_refused_total", "reason", "unauthenticated_limit"); v < 6 {
		t.Errorf("rblkd_refused_total{reason=\"unauthenticated_limit\"} = %v, want at least 6", v)
	}
	eventually(t, "rblkd_auth_failures_total{reason=\"timeout\"} = 3", func() bool {
		return labeled(t, reg, "rblkd_auth_failures_total", "reason", "timeout") == 3 &&
			labeled(t, reg, "rblkd_refused_total", "reason", "unauthenticated_evicted") == 1
	})
}

// TestHandshakeTimeoutFromAccept: the handshake timeout runs from the
// TCP accept, not from the connect request: a client whose connect
// request is held up (a proxy stalls it) for most of the timeout is closed
// at the timeout, not that much later.
func TestHandshakeTimeoutFromAccept(t *testing.T) {
	needTCP(t)
	const timeout = 2 * time.Second
	e, _ := startWith(t, make([]byte, 256<<10), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Auth: testKeys(t),
		HandshakeTimeout: timeout}, target.ExportConfig{})
	px, err := faultproxy.New("127.0.0.1:0", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer px.Close()
	px.StallAll()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	dialed := make(chan *link.Link, 1)
	go func() {
		l, err := link.Dial(ctx, e.p, px.Addr(), link.Options{Handler: func(protocol.Header, []byte) {}})
		if err != nil {
			t.Errorf("dial through the proxy: %v", err)
		}
		dialed <- l
	}()
	if _, err := px.WaitConn(ctx, 0); err != nil {
		t.Fatal(err)
	}
	// The target accepted the stream; its connect request comes 80% of
	// the timeout later.
	resume := time.AfterFunc(time.Until(start.Add(timeout*8/10)), px.ResumeAll)
	defer resume.Stop()
	l := <-dialed
	if l == nil {
		return
	}
	defer l.Close()
	select {
	case <-l.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the target kept a connection that never authenticated")
	}
	// From the connect request it would be 1.8 timeouts.
	if took := time.Since(start); took > timeout*14/10 {
		t.Fatalf("closed %v after the TCP connect, want about %v (the handshake timeout from the accept)", took, timeout)
	}
}

// TestFailedProofsLimitedByPeer: an address that keeps failing is refused
// at AuthStart, saying so, and counted; the real host at another address
// is not held up, and the address gets in again once it stops.
func TestFailedProofsLimitedByPeer(t *testing.T) {
	e, reg := startWith(t, make([]byte, 256<<10), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Auth: testKeys(t),
		FailedAuthPerPeer: target.RateLimit{Burst: 3, Every: 500 * time.Millisecond}}, target.ExportConfig{})
	limited := 0
	for i := range 30 {
		_, err := e.connectFrom2("127.0.0.2", "host-a", secretB)
		switch {
		case err == nil:
			t.Fatal("a wrong secret got in")
		case strings.Contains(err.Error(), "too many failed authentications from 127.0.0.2: retry in"):
			limited++
		case i < 3 && !strings.Contains(err.Error(), `wrong secret for host "host-a"`):
			t.Fatalf("wrong secret %d: %v", i, err)
		}
		if !errors.Is(err, auth.ErrFailed) {
			t.Fatalf("attempt %d: %v, want an authentication failure", i, err)
		}
	}
	if limited < 20 {
		t.Fatalf("%d of 30 quick wrong secrets from one address were rate limited, want most", limited)
	}
	if v := labeled(t, reg, "rblkd_auth_rate_limited_total", "by", "peer"); v != float64(limited) {
		t.Fatalf("rblkd_auth_rate_limited_total{by=\"peer\"} = %v, want %d", v, limited)
	}
	if v := labeled(t, reg, "rblkd_auth_failures_total", "reason", "rate_limited"); v != float64(limited) {
		t.Fatalf("rblkd_auth_failures_total{reason=\"rate_limited\"} = %v, want %d", v, limited)
	}
	// The real host, elsewhere, gets in at once.
	if _, err := e.connect("host-a", secretA); err != nil {
		t.Fatalf("real host while its ID is attacked from another address: %v", err)
	}
	// The attacker's address recovers once it stops: the right secret
	// from there works within an interval or so.
	eventually(t, "the right secret from the limited address gets in", func() bool {
		_, err := e.connectFrom("127.0.0.2", "host-a", secretA)
		return err == nil
	})
}

// connectFrom2 is connectFrom, skipped on other transports.
func (e *env) connectFrom2(local, host string, secret []byte) (*link.Link, error) {
	needTCP(e.t)
	return e.connectFrom(local, host, secret)
}

// TestFailedProofsLimitedByHost: wrong proofs for one host ID from many
// addresses are answered late beyond the host's limit, saying so and
// counted; the host with the right secret is never held up or refused.
func TestFailedProofsLimitedByHost(t *testing.T) {
	e, reg := startWith(t, make([]byte, 256<<10), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Auth: testKeys(t),
		FailedAuthPerHost: target.RateLimit{Burst: 2, Every: time.Hour}}, target.ExportConfig{})
	for i := range 5 {
		_, err := e.connectFrom2(fmt.Sprintf("127.0.0.%d", 10+i), "host-a", secretB)
		if !errors.Is(err, auth.ErrFailed) || !strings.Contains(err.Error(), `wrong secret for host "host-a"`) {
			t.Fatalf("wrong secret %d: %v", i, err)
		}
		if late := strings.Contains(err.Error(), "answered late: too many wrong secrets for this host"); late != (i >= 2) {
			t.Fatalf("wrong secret %d answered late: %v (%v)", i, late, err)
		}
		// The real host gets in between the attacker's tries.
		if _, err := e.connect("host-a", secretA); err != nil {
			t.Fatalf("real host after %d wrong secrets for it: %v", i+1, err)
		}
	}
	if v := labeled(t, reg, "rblkd_auth_rate_limited_total", "by", "host"); v != 3 {
		t.Fatalf("rblkd_auth_rate_limited_total{by=\"host\"} = %v, want 3", v)
	}
	if v := labeled(t, reg, "rblkd_auth_failures_total", "reason", "wrong_secret"); v != 5 {
		t.Fatalf("rblkd_auth_failures_total{reason=\"wrong_secret\"} = %v, want 5", v)
	}
}

// TestLogBounded: what a client can repeat at will (Opens, refused Opens,
// wrong secrets) makes a bounded log: the first lines of each kind from
// an address, then nothing but a count; another client's lines still show.
func TestLogBounded(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	e, reg := startWith(t, make([]byte, 256<<10), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Auth: testKeys(t),
		Logger: zap.New(core), LogLimit: target.RateLimit{Burst: 5, Every: time.Hour}}, target.ExportConfig{Shared: true})
	l, err := e.connect("host-a", secretA)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// 3,000 Opens, 32 at a time; each that gets a handle closes it again.
	const opens = 3000
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	var mu sync.Mutex
	var refused int
	for range opens {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			var info protocol.VolumeInfo
			err := l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadOnly, Name: "vol", HostID: "host-a"}, &info)
			if err != nil {
				mu.Lock()
				refused++
				mu.Unlock()
				if !errors.Is(err, protocol.ErrBusy) {
					t.Errorf("open: %v", err)
				}
				return
			}
			if err := l.Request(ctx, &protocol.Close{Handle: info.Handle}, &protocol.OK{}); err != nil {
				t.Errorf("close: %v", err)
			}
		}()
	}
	wg.Wait()
	// Wrong secrets from one address, as many as the per-peer limit lets
	// through.
	for range 10 {
		e.connectFrom2("127.0.0.2", "host-b", secretA)
	}
	lines := logs.Len()
	t.Logf("%d Opens (%d refused) and 10 wrong secrets: %d log lines", opens, refused, lines)
	for _, msg := range []string{"volume opened", "authentication refused"} {
		if n := logs.FilterMessage(msg).Len(); n == 0 || n > 5 {
			t.Errorf("%d lines %q, want 1 to 5 (the first ones)", n, msg)
		}
	}
	if refused > 0 {
		if n := logs.FilterMessage("request failed").Len(); n == 0 || n > 5 {
			t.Errorf("%d lines \"request failed\" for %d refused Opens, want 1 to 5", n, refused)
		}
	}
	if lines > 60 {
		t.Errorf("%d log lines, want a bounded few", lines)
	}
	if v := gauge(t, reg, "rblkd_log_lines_suppressed_total"); v < opens-10 {
		t.Errorf("rblkd_log_lines_suppressed_total = %v, want about %d", v, opens)
	}
	// Another address's lines are its own.
	c, err := e.connectFrom2("127.0.0.3", "host-b", secretB)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Request(ctx, &protocol.Open{Mode: protocol.ModeReadOnly, Name: "vol", HostID: "host-b"}, &protocol.VolumeInfo{}); err != nil {
		t.Fatal(err)
	}
	if logs.FilterMessage("volume opened").FilterField(zap.String("host_id", "host-b")).Len() != 1 {
		t.Error("another address's Open was not logged")
	}
}

// TestNewRefusesBadLimits: limits that would refuse everything, or never
// refill, are refused at New, naming the limit.
func TestNewRefusesBadLimits(t *testing.T) {
	dir := t.TempDir()
	for want, o := range map[string]target.Options{
		"max unauthenticated -1":          {MaxUnauthenticated: -1},
		"max handles per session -3":      {MaxHandlesPerSession: -3},
		"max sessions -1":                 {MaxSessions: -1},
		"failed authentications per peer": {FailedAuthPerPeer: target.RateLimit{Burst: 5}},
		"log limit":                       {LogLimit: target.RateLimit{Every: time.Second}},
		"handshake timeout -1s":           {HandshakeTimeout: -time.Second},
	} {
		o.Exports = []target.ExportConfig{{Name: "v", Path: filepath.Join(dir, "v"), Size: 1 << 20}}
		tg, err := target.New(o)
		if err == nil {
			tg.Close()
			t.Errorf("%s: New succeeded", want)
			continue
		}
		if !strings.Contains(err.Error(), want) {
			t.Errorf("New with %s: %v", want, err)
		}
	}
}
