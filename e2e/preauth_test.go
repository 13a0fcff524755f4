package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
)

// localPeer is the address rblkd sees a process of its own host come
// from that dials rblkd's address (rblk-attach, a raw client over rdma):
// that address itself, as the kernel connects to a local address from it.
func localPeer() string { return e2e.host }

// clientProvider is the transport of a raw client of rblkd that plays
// another host than the real one: over tcp it connects from the loopback
// address local (the real host is on 127.0.0.1). Over rdma a client
// cannot choose its address (the verbs provider dials from the address of
// the device that reaches rblkd): every client comes from localPeer(), the
// real host too. peer is the address rblkd sees it come from.
func clientProvider(t *testing.T, local string) (p transport.Provider, peer string) {
	t.Helper()
	if e2e.transport == "tcp" {
		return tcp.NewWithOptions("tcp", tcp.Options{LocalAddr: local + ":0"}), local
	}
	return testProvider(t), localPeer()
}

// silentSession is a connection to rblkd on the run's transport that
// exchanged hellos (the transport's connect request, answered) and then
// says nothing: it never authenticates. closed gets the time its link
// went down (rblkd closed it).
type silentSession struct {
	l *link.Link
	lifetime
}

// lifetime is when a silent connection's dial started and returned and,
// once, when rblkd closed it.
type lifetime struct {
	dialed    time.Time // the dial started
	connected time.Time // the dial returned: rblkd had accepted it by then
	closed    chan time.Time
}

// closedWithin fails t unless rblkd closed the connection within d of its
// dial's return. rblkd's timeouts run from its accept, which is before
// the dial returns: over rdma in an emulated guest a dial may itself take
// seconds, so its start is no reference.
func (s *lifetime) closedWithin(t *testing.T, d time.Duration, what string) {
	t.Helper()
	select {
	case at := <-s.closed:
		if took := at.Sub(s.connected); took > d {
			t.Errorf("%s closed %v after its dial returned (%v after it started), want at most %v", what, took, at.Sub(s.dialed), d)
		}
	case <-time.After(time.Until(s.connected.Add(d)) + 30*time.Second):
		t.Fatalf("%s still open %v after its dial returned", what, time.Since(s.connected))
	}
}

// dialSilentSession connects to addr with p and sends nothing more. It
// returns the dial's error (rblkd refused the connection) and when the
// dial started.
func dialSilentSession(t *testing.T, p transport.Provider, addr string) (*silentSession, time.Time, error) {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), patient(10*time.Second))
	defer cancel()
	l, err := link.Dial(ctx, p, addr, link.Options{Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		return nil, start, err
	}
	s := &silentSession{l: l, lifetime: lifetime{dialed: start, connected: time.Now(), closed: make(chan time.Time, 1)}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-l.Done()
		s.closed <- time.Now()
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	return s, start, nil
}

// rawAuth connects to addr with p and authenticates as host with secret.
func rawAuth(ctx context.Context, p transport.Provider, addr, host string, secret []byte) (*link.Link, error) {
	l, err := link.Dial(ctx, p, addr, link.Options{Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		return nil, err
	}
	if _, err := auth.Initiate(ctx, l, host, secret); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// logBounded fails t unless rblkd's log out has each of msgs at least once
// and at most as often as its log limiter lets one address write a kind
// of line in the time since start (a burst of 20, then one a second).
func logBounded(t *testing.T, out string, start time.Time, msgs ...string) {
	t.Helper()
	most := 20 + int(time.Since(start).Seconds()) + 1
	for _, msg := range msgs {
		if n := strings.Count(out, msg); n == 0 || n > most {
			t.Errorf("rblkd logged %q %d times, want 1 to %d", msg, n, most)
		}
	}
	if n := strings.Count(out, "\n"); n > 400 {
		t.Errorf("rblkd wrote %d log lines, want a bounded few", n)
	}
}

// TestBeforeAuthentication drives rblkd's limits before authentication
// with its flags, from hostile raw clients on the run's transport (over
// tcp from other loopback addresses than the real host's 127.0.0.1; over
// rdma every client comes from rblkd's own address, see clientProvider):
//   - connections that are accepted (hellos exchanged) and then stay
//     silent: beyond --max-unauthenticated they are refused at once,
//     saying why, and every one held is closed within --handshake-timeout
//     of its accept; then the real host lists and attaches (rblk-attach);
//   - Opens beyond --max-handles-per-session are refused, naming the flag;
//   - wrong secrets from one address are refused, then rate limited,
//     saying so (last: over rdma that address is everyone's);
//   - all counted in the metrics, and rblkd's log stays a few lines.
//
// Silent TCP streams, before any connect request, are the software
// transport's own: TestBeforeAuthenticationTCPStreams.
func TestBeforeAuthentication(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	start := time.Now()
	authFile, secretA, _ := authFiles(t)
	dir := t.TempDir()
	// The held connections must outlive the dials beyond the limit: over
	// rdma in the guest a dial takes 100-200 ms, and 8 held plus 20
	// refused took longer than 2 s.
	handshake := 2 * time.Second
	if e2eTransport() == "rdma" {
		handshake = 8 * time.Second
	}
	// (rblkd's setting: under emulation a dial alone may take seconds)
	handshake = patient(handshake)
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=4M,shared"}, "--auth-file", authFile,
		"--handshake-timeout", handshake.String(), "--max-unauthenticated", "8", "--max-handles-per-session", "4")

	// Silent connections from one address, at the limit and beyond it.
	silent, _ := clientProvider(t, "127.0.0.2")
	var held []*silentSession
	for i := range 8 {
		s, _, err := dialSilentSession(t, silent, tg.addr)
		if err != nil {
			t.Fatalf("silent connection %d, within --max-unauthenticated: %v", i+1, err)
		}
		held = append(held, s)
	}
	refused := 0
	for i := range 20 {
		if time.Since(held[0].dialed) > handshake*3/4 {
			// The first held ones time out soon, and free their places:
			// a dial now might rightly get in.
			break
		}
		refused++
		_, dialed, err := dialSilentSession(t, silent, tg.addr)
		took := time.Since(dialed)
		var re *protocol.RemoteError
		switch {
		case err == nil:
			t.Fatalf("silent connection %d beyond --max-unauthenticated was accepted %v after the first held one's dial (handshake timeout %v)", 9+i, time.Since(held[0].dialed), handshake)
		case !errors.As(err, &re) || !errors.Is(err, protocol.ErrBusy) || !strings.Contains(err.Error(), "too many connections waiting to authenticate (limit 8"):
			t.Errorf("silent connection %d beyond --max-unauthenticated: %v, want rblkd's refusal saying why", 9+i, err)
		case took > handshake/2:
			t.Errorf("silent connection %d beyond --max-unauthenticated refused %v after its dial, want at most %v", 9+i, took, handshake/2)
		}
	}
	// rblkd closes each at its handshake timeout; the slack is for the
	// close to reach this end (a disconnect event, under emulation slow).
	for i, s := range held {
		s.closedWithin(t, handshake+patient(time.Second), fmt.Sprintf("silent connection %d", i+1))
	}
	if refused < 5 {
		t.Errorf("only %d dials beyond --max-unauthenticated fit in %v of the handshake timeout, want at least 5", refused, handshake*3/4)
	}
	if v := metric(t, tg.metrics, "rblkd_refused_total", `reason="unauthenticated_limit"`); v != float64(refused) {
		t.Errorf("rblkd_refused_total{reason=\"unauthenticated_limit\"} = %v, want %d", v, refused)
	}
	if v := metric(t, tg.metrics, "rblkd_auth_failures_total", `reason="timeout"`); v != 8 {
		t.Errorf("rblkd_auth_failures_total{reason=\"timeout\"} = %v, want 8", v)
	}
	waitMetric(t, tg.metrics, "rblkd_sessions_unauthenticated", func(v float64) bool { return v == 0 }, "0 once the silent connections are closed")

	// The real host lists and attaches.
	r := mustRun(t, 30*time.Second, attachBin, "list", "--host-id", "host-a", "--secret-file", secretA, "--transport", e2eTransport(), "--target", tg.addr)
	if !strings.Contains(r.stdout, "vol") {
		t.Errorf("rblk-attach list after the silent connections: %q", r.stdout)
	}
	at := startAttach(t, tg, "vol", "--host-id", "host-a", "--secret-file", secretA)
	qemuIO(t, at.uri("vol"), []qop{{kind: 'w', pattern: 0x6b, n: 64 << 10}, {kind: 'r', pattern: 0x6b, n: 64 << 10}})

	// Opens beyond --max-handles-per-session, many of them.
	ctx, cancel := context.WithTimeout(context.Background(), patient(60*time.Second))
	defer cancel()
	pb, _ := clientProvider(t, "127.0.0.4")
	l, err := rawAuth(ctx, pb, tg.addr, "host-b", []byte(e2eSecretB))
	if err != nil {
		t.Fatal(err)
	}
	opened, refused := 0, 0
	for range 2000 {
		err := l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadOnly, Name: "vol", HostID: "host-b"}, &protocol.VolumeInfo{})
		switch {
		case err == nil:
			opened++
		case errors.Is(err, protocol.ErrBusy) && strings.Contains(err.Error(), "--max-handles-per-session"):
			refused++
		default:
			t.Fatalf("open: %v", err)
		}
	}
	l.Close()
	if opened != 4 || refused != 1996 {
		t.Errorf("2000 Opens on one session: %d opened, %d refused; want 4 and 1996", opened, refused)
	}
	if v := metric(t, tg.metrics, "rblkd_refused_total", `reason="handle_limit"`); v != 1996 {
		t.Errorf("rblkd_refused_total{reason=\"handle_limit\"} = %v, want 1996", v)
	}

	// Wrong secrets from one address: refused, then rate limited (a burst
	// of 10, then one a second: rblkd's default), until 5 were limited.
	// The attempts go 4 at a time, as an attacker's would: one after
	// another, each would have to take less than the second the bucket
	// refills in, which a dial over rdma under emulation may not. Refused
	// as wrong, not limited, are at most the burst, what refilled
	// meanwhile and the attempts in flight when the bucket ran dry (each
	// was let through at its AuthStart, and its wrong proof is refused as
	// wrong). An attempt may also find the connections waiting to
	// authenticate at rblkd's limit (8) while those refused before it
	// are torn down: refused as busy, counted apart.
	const guessers = 4
	pw, peer := clientProvider(t, "127.0.0.3")
	var mu sync.Mutex
	var limited, wrong, busy, tries int
	var unexpected error
	first := time.Now()
	var guessing sync.WaitGroup
	for range guessers {
		guessing.Go(func() {
			for {
				mu.Lock()
				if limited >= 5 || tries >= 80 || unexpected != nil {
					mu.Unlock()
					return
				}
				tries++
				try := tries
				mu.Unlock()
				_, err := rawAuth(ctx, pw, tg.addr, "host-a", []byte("not-the-secret-of-host-a"))
				mu.Lock()
				switch {
				case err == nil:
					unexpected = errors.New("a wrong secret got in")
				case strings.Contains(err.Error(), "too many failed authentications from "+peer+": retry in "):
					limited++
				case strings.Contains(err.Error(), `wrong secret for host "host-a"`):
					wrong++
				case strings.Contains(err.Error(), "too many connections waiting to authenticate"):
					busy++
				default:
					unexpected = fmt.Errorf("wrong secret %d: %w, want it refused or rate limited", try, err)
				}
				mu.Unlock()
			}
		})
	}
	guessing.Wait()
	if unexpected != nil {
		t.Fatal(unexpected)
	}
	took := time.Since(first)
	t.Logf("%d wrong secrets from one address, %d at a time, in %v: %d refused as wrong, %d rate limited, %d refused as busy", tries, guessers, took.Round(time.Millisecond), wrong, limited, busy)
	if most := 10 + int(took/time.Second) + guessers; limited < 5 || wrong > most {
		t.Errorf("%d wrong secrets from one address in %v: %d refused as wrong, %d rate limited; want at most %d refused as wrong (a burst of 10, one a second, %d in flight) and the rest limited",
			tries, took.Round(time.Millisecond), wrong, limited, most, guessers)
	}
	if v := metric(t, tg.metrics, "rblkd_auth_rate_limited_total", `by="peer"`); v != float64(limited) {
		t.Errorf("rblkd_auth_rate_limited_total{by=\"peer\"} = %v, want %d", v, limited)
	}

	// The real host went on through all that.
	qemuIO(t, at.uri("vol"), []qop{{kind: 'r', pattern: 0x6b, n: 64 << 10}})
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	out := tg.out.String()
	t.Logf("rblkd: %d log lines after %d silent connections, 2000 Opens and %d wrong secrets", strings.Count(out, "\n"), 8+refused, tries)
	logBounded(t, out, start, "request failed", "authentication refused", "session refused: too many connections waiting to authenticate",
		"closing a connection that did not authenticate in time")
	noSecrets(t, out)
}

// silentConn is a TCP connection that says nothing; closed gets the time
// rblkd closed it.
type silentConn struct {
	nc net.Conn
	lifetime
}

// dialSilent connects to addr from the loopback address local (another
// "host" than the real one on 127.0.0.1) and sends nothing.
func dialSilent(t *testing.T, addr, local string) *silentConn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}, Timeout: 5 * time.Second}
	start := time.Now()
	nc, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &silentConn{nc: nc, lifetime: lifetime{dialed: start, connected: time.Now(), closed: make(chan time.Time, 1)}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		nc.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, err := io.Copy(io.Discard, nc)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return
		}
		s.closed <- time.Now()
	}()
	t.Cleanup(func() {
		nc.Close()
		<-done
	})
	return s
}

// TestBeforeAuthenticationTCPStreams: the software transport's listener
// holds TCP streams until their connect request, within rblkd's limits:
// silent streams (from 127.0.0.2) beyond --max-unauthenticated are closed
// at once, and every silent one within --handshake-timeout of its TCP
// accept, while the real host (127.0.0.1) lists and attaches through a
// steady flood of them; counted in the metrics, and logged a few lines,
// at the stage "connect request".
func TestBeforeAuthenticationTCPStreams(t *testing.T) {
	t.Parallel()
	onlyTransport(t, "tcp", "silent TCP streams before their connect request, held by the software transport's listener (its pending cap and its handshake timeout from the TCP accept); "+
		"over rdma a connection starts with its connect request, and TestBeforeAuthentication has the connections that stay silent after it")
	needTools(t, "qemu-io")
	start := time.Now()
	authFile, secretA, _ := authFiles(t)
	dir := t.TempDir()
	const handshake = 2 * time.Second
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=4M,shared"}, "--auth-file", authFile,
		"--handshake-timeout", handshake.String(), "--max-unauthenticated", "8")

	// A flood of silent connections from 127.0.0.2, kept at the limit.
	var held []*silentConn
	for range 8 {
		held = append(held, dialSilent(t, tg.addr, "127.0.0.2"))
	}
	for i := range 20 {
		s := dialSilent(t, tg.addr, "127.0.0.2")
		s.closedWithin(t, handshake/2, fmt.Sprintf("silent connection %d beyond --max-unauthenticated", 9+i))
	}
	// rblkd closes each at its handshake timeout; the slack is for the
	// close to reach this end (a disconnect event, under emulation slow).
	for i, s := range held {
		s.closedWithin(t, handshake+patient(time.Second), fmt.Sprintf("silent connection %d", i+1))
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	flooded := 0
	wg.Add(1)
	go func() {
		defer wg.Done()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}, Timeout: time.Second}
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			select {
			case <-stop:
				return
			default:
			}
			c, err := d.Dial("tcp", tg.addr)
			if err != nil {
				continue
			}
			conns = append(conns, c)
			mu.Lock()
			flooded++
			mu.Unlock()
			if len(conns) > 64 {
				conns[0].Close()
				conns = conns[1:]
			}
			time.Sleep(5 * time.Millisecond) // a steady flood, not a busy loop
		}
	}()
	// The real host lists and attaches through the flood.
	r := mustRun(t, 30*time.Second, attachBin, "list", "--host-id", "host-a", "--secret-file", secretA, "--transport", e2eTransport(), "--target", tg.addr)
	if !strings.Contains(r.stdout, "vol") {
		t.Errorf("rblk-attach list during the flood: %q", r.stdout)
	}
	at := startAttach(t, tg, "vol", "--host-id", "host-a", "--secret-file", secretA)
	qemuIO(t, at.uri("vol"), []qop{{kind: 'w', pattern: 0x6b, n: 64 << 10}, {kind: 'r', pattern: 0x6b, n: 64 << 10}})
	close(stop)
	wg.Wait()
	if v := metric(t, tg.metrics, "rblkd_refused_total", `reason="unauthenticated_limit"`); v < 20 {
		t.Errorf("rblkd_refused_total{reason=\"unauthenticated_limit\"} = %v, want at least 20", v)
	}
	if v := metric(t, tg.metrics, "rblkd_auth_failures_total", `reason="timeout"`); v < 8 {
		t.Errorf("rblkd_auth_failures_total{reason=\"timeout\"} = %v, want at least 8", v)
	}

	qemuIO(t, at.uri("vol"), []qop{{kind: 'r', pattern: 0x6b, n: 64 << 10}})
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	out := tg.out.String()
	mu.Lock()
	t.Logf("rblkd: %d log lines after %d silent flood connections", strings.Count(out, "\n"), flooded+28)
	mu.Unlock()
	logBounded(t, out, start, "session refused: too many connections waiting to authenticate", "closing a connection that did not authenticate in time")
	if !strings.Contains(out, `"stage": "connect request"`) {
		t.Errorf("rblkd's log does not say the silent streams were dropped before their connect request:\n%s", out)
	}
	noSecrets(t, out)
}
