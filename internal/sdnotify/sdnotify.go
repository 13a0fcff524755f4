package sdnotify

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// EnvSocket is the environment variable systemd sets to its notification
// socket.
const EnvSocket = "NOTIFY_SOCKET"

// ErrBadSocket is returned when $NOTIFY_SOCKET is not a path or an
// abstract socket's name ('@NAME').
var ErrBadSocket = errors.New("sdnotify: $NOTIFY_SOCKET is neither an absolute path nor '@NAME'")

// sendTimeout bounds one datagram's send when the context has no deadline:
// systemd reads its socket promptly, a stuck one must not stall the
// service.
const sendTimeout = 5 * time.Second

// Enabled reports whether $NOTIFY_SOCKET is set, that is whether the
// messages go anywhere.
func Enabled() bool { return os.Getenv(EnvSocket) != "" }

// Send sends state, one or more "KEY=VALUE" lines, to $NOTIFY_SOCKET in one
// datagram. It returns nil and does nothing when $NOTIFY_SOCKET is unset.
func Send(ctx context.Context, state string) error {
	path := os.Getenv(EnvSocket)
	if path == "" {
		return nil
	}
	if !strings.HasPrefix(path, "/") && !strings.HasPrefix(path, "@") {
		return fmt.Errorf("%w: %q", ErrBadSocket, path)
	}
	// Go's net package maps a leading '@' to the abstract namespace.
	addr := &net.UnixAddr{Name: path, Net: "unixgram"}
	var d net.Dialer
	dctx := ctx
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		dctx, cancel = context.WithTimeout(ctx, sendTimeout)
		defer cancel()
	}
	c, err := d.DialContext(dctx, "unixgram", addr.String())
	if err != nil {
		return fmt.Errorf("sdnotify: dial %s: %w", path, err)
	}
	defer c.Close()
	if dl, ok := dctx.Deadline(); ok {
		c.SetWriteDeadline(dl)
	}
	if _, err := c.Write([]byte(state)); err != nil {
		return fmt.Errorf("sdnotify: send %q to %s: %w", firstLine(state), path, err)
	}
	return nil
}

// Ready tells systemd the service is up: for Type=notify, the start job
// completes (and units ordered after it start) only now.
func Ready(ctx context.Context) error { return Send(ctx, "READY=1") }

// Reloading tells systemd a reload started; send Ready when it is over
// (whether it succeeded or the old configuration stays). It carries
// MONOTONIC_USEC, which Type=notify-reload requires.
func Reloading(ctx context.Context) error {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return fmt.Errorf("sdnotify: clock_gettime(CLOCK_MONOTONIC): %w", err)
	}
	usec := ts.Sec*1_000_000 + ts.Nsec/1_000
	return Send(ctx, fmt.Sprintf("RELOADING=1\nMONOTONIC_USEC=%d", usec))
}

// Stopping tells systemd the service is shutting down.
func Stopping(ctx context.Context) error { return Send(ctx, "STOPPING=1") }

// Status sets the one-line status systemctl status shows.
func Status(ctx context.Context, status string) error {
	return Send(ctx, "STATUS="+strings.ReplaceAll(status, "\n", " "))
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
