package sdnotify

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// listen makes a unixgram socket at name (a path, or '@NAME') and points
// $NOTIFY_SOCKET at it.
func listen(t *testing.T, name string) *net.UnixConn {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
	if err != nil {
		t.Fatalf("listen %s: %v", name, err)
	}
	t.Cleanup(func() { c.Close() })
	t.Setenv(EnvSocket, name)
	return c
}

// recv returns the next datagram on c.
func recv(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 4096)
	n, err := c.Read(b)
	if err != nil {
		t.Fatalf("read the notification: %v", err)
	}
	return string(b[:n])
}

func TestMessages(t *testing.T) {
	for _, kind := range []string{"path", "abstract"} {
		t.Run(kind, func(t *testing.T) {
			name := filepath.Join(t.TempDir(), "notify.sock")
			if kind == "abstract" {
				name = fmt.Sprintf("@rblk-sdnotify-test-%d", time.Now().UnixNano())
			}
			c := listen(t, name)
			ctx := context.Background()
			if !Enabled() {
				t.Fatal("Enabled() is false with NOTIFY_SOCKET set")
			}
			if err := Ready(ctx); err != nil {
				t.Fatal(err)
			}
			if got := recv(t, c); got != "READY=1" {
				t.Errorf("Ready sent %q, want READY=1", got)
			}
			if err := Status(ctx, "serving 2 exports\nsecond line"); err != nil {
				t.Fatal(err)
			}
			if got := recv(t, c); got != "STATUS=serving 2 exports second line" {
				t.Errorf("Status sent %q", got)
			}
			var before unix.Timespec
			unix.ClockGettime(unix.CLOCK_MONOTONIC, &before)
			if err := Reloading(ctx); err != nil {
				t.Fatal(err)
			}
			got := recv(t, c)
			lines := strings.Split(got, "\n")
			if len(lines) != 2 || lines[0] != "RELOADING=1" || !strings.HasPrefix(lines[1], "MONOTONIC_USEC=") {
				t.Fatalf("Reloading sent %q, want RELOADING=1 and MONOTONIC_USEC=", got)
			}
			usec, err := strconv.ParseInt(strings.TrimPrefix(lines[1], "MONOTONIC_USEC="), 10, 64)
			if want := before.Sec*1e6 + before.Nsec/1e3; err != nil || usec < want || usec > want+10e6 {
				t.Errorf("MONOTONIC_USEC=%d (%v), want the monotonic clock, about %d", usec, err, want)
			}
			if err := Stopping(ctx); err != nil {
				t.Fatal(err)
			}
			if got := recv(t, c); got != "STOPPING=1" {
				t.Errorf("Stopping sent %q, want STOPPING=1", got)
			}
		})
	}
}

func TestUnsetIsNoop(t *testing.T) {
	t.Setenv(EnvSocket, "")
	if Enabled() {
		t.Error("Enabled() with NOTIFY_SOCKET empty")
	}
	for _, f := range []func(context.Context) error{Ready, Reloading, Stopping} {
		if err := f(context.Background()); err != nil {
			t.Errorf("without NOTIFY_SOCKET: %v, want nil", err)
		}
	}
}

func TestErrors(t *testing.T) {
	t.Setenv(EnvSocket, "relative/notify.sock")
	if err := Ready(context.Background()); !errors.Is(err, ErrBadSocket) {
		t.Errorf("relative NOTIFY_SOCKET: %v, want ErrBadSocket", err)
	}
	missing := filepath.Join(t.TempDir(), "nobody-listens.sock")
	t.Setenv(EnvSocket, missing)
	if err := Ready(context.Background()); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("NOTIFY_SOCKET with no listener: %v, want an error naming %s", err, missing)
	}
}
