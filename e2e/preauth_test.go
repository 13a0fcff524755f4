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
	"github.com/rblk/rblk/transport/tcp"
)

// silentConn is a TCP connection that says nothing; closed gets the time
// rblkd closed it.
type silentConn struct {
	nc     net.Conn
	dialed time.Time
	closed chan time.Time
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
	s := &silentConn{nc: nc, dialed: start, closed: make(chan time.Time, 1)}
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

// closedWithin fails t unless rblkd closed s within d of its dial.
func (s *silentConn) closedWithin(t *testing.T, d time.Duration, what string) {
	t.Helper()
	select {
	case at := <-s.closed:
		if took := at.Sub(s.dialed); took > d {
			t.Errorf("%s closed %v after its dial, want at most %v", what, took, d)
		}
	case <-time.After(time.Until(s.dialed.Add(d)) + 30*time.Second):
		t.Fatalf("%s still open %v after its dial", what, time.Since(s.dialed))
	}
}

// rawAuth connects to addr from local and authenticates as host with
// secret.
func rawAuth(ctx context.Context, addr, local, host string, secret []byte) (*link.Link, error) {
	p := tcp.NewWithOptions("tcp", tcp.Options{LocalAddr: local + ":0"})
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

// TestBeforeAuthentication drives rblkd's limits before authentication
// with its flags, from hostile raw clients at other loopback addresses
// than the real host's (127.0.0.1):
//   - silent TCP connections beyond --max-unauthenticated are closed at
//     once, and every silent one within --handshake-timeout of its accept,
//     while the real host lists and attaches (rblk-attach) meanwhile;
//   - wrong secrets from one address are refused, rate limited, saying so;
//   - Opens beyond --max-handles-per-session are refused, naming the flag;
//   - all counted in the metrics, and rblkd's log stays a few lines.
func TestBeforeAuthentication(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	start := time.Now()
	authFile, secretA, _ := authFiles(t)
	dir := t.TempDir()
	const handshake = 2 * time.Second
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=4M,shared"}, "--auth-file", authFile,
		"--handshake-timeout", handshake.String(), "--max-unauthenticated", "8", "--max-handles-per-session", "4")

	// A flood of silent connections from 127.0.0.2, kept at the limit.
	var held []*silentConn
	for range 8 {
		held = append(held, dialSilent(t, tg.addr, "127.0.0.2"))
	}
	for i := range 20 {
		s := dialSilent(t, tg.addr, "127.0.0.2")
		s.closedWithin(t, handshake/2, fmt.Sprintf("silent connection %d beyond --max-unauthenticated", 9+i))
	}
	for i, s := range held {
		s.closedWithin(t, handshake+time.Second, fmt.Sprintf("silent connection %d", i+1))
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
	r := mustRun(t, 30*time.Second, attachBin, "list", "--host-id", "host-a", "--secret-file", secretA, "--transport", "tcp", "--target", tg.addr)
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

	// Wrong secrets from 127.0.0.3: refused, then rate limited.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	limited := 0
	for range 15 {
		_, err := rawAuth(ctx, tg.addr, "127.0.0.3", "host-a", []byte("not-the-secret-of-host-a"))
		if err == nil {
			t.Fatal("a wrong secret got in")
		}
		if strings.Contains(err.Error(), "too many failed authentications from 127.0.0.3") {
			limited++
		}
	}
	if limited < 5 {
		t.Errorf("%d of 15 quick wrong secrets from one address rate limited, want the ones past the first 10", limited)
	}
	if v := metric(t, tg.metrics, "rblkd_auth_rate_limited_total", `by="peer"`); v != float64(limited) {
		t.Errorf("rblkd_auth_rate_limited_total{by=\"peer\"} = %v, want %d", v, limited)
	}

	// Opens beyond --max-handles-per-session, many of them.
	l, err := rawAuth(ctx, tg.addr, "127.0.0.4", "host-b", []byte(e2eSecretB))
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

	qemuIO(t, at.uri("vol"), []qop{{kind: 'r', pattern: 0x6b, n: 64 << 10}})
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	out := tg.out.String()
	mu.Lock()
	t.Logf("rblkd: %d log lines after %d silent flood connections, 15 wrong secrets and 2000 Opens", strings.Count(out, "\n"), flooded+28)
	mu.Unlock()
	// A burst of 20 lines of a kind from an address, then one a second.
	most := 20 + int(time.Since(start).Seconds()) + 1
	for _, msg := range []string{"request failed", "authentication refused", "session refused: too many connections waiting to authenticate",
		"closing a connection that did not authenticate in time"} {
		if n := strings.Count(out, msg); n == 0 || n > most {
			t.Errorf("rblkd logged %q %d times, want 1 to %d", msg, n, most)
		}
	}
	if n := strings.Count(out, "\n"); n > 400 {
		t.Errorf("rblkd wrote %d log lines, want a bounded few", n)
	}
	noSecrets(t, out)
}
