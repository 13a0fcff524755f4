package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rblk/rblk/admin"
)

// listen serves a handler that answers list with one export, in a fresh
// world-traversable directory (the non-root test dials it).
func listen(t *testing.T, calls *atomic.Int32) *admin.Server {
	t.Helper()
	t.Cleanup(func() { goleak.VerifyNone(t) })
	dir, err := os.MkdirTemp("", "rblk-admin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "run", "rblkd.sock")
	s, err := admin.Listen(path, func(ctx context.Context, req admin.Request) admin.Response {
		calls.Add(1)
		switch req.Command {
		case admin.CmdList:
			return admin.Response{OK: true, Exports: []admin.Export{{Name: "vol", Path: "/v", Size: 4096}}}
		case admin.CmdRemove:
			return admin.Response{Error: "export \"" + req.Name + "\": no such export"}
		}
		return admin.Response{Error: "unknown command " + req.Command}
	}, admin.ServerOptions{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func TestRoundTrip(t *testing.T) {
	var calls atomic.Int32
	s := listen(t, &calls)
	st, err := os.Stat(s.Path())
	if err != nil || st.Mode().Perm() != 0o600 || st.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket %v, %v: want a socket of mode 0600", st.Mode(), err)
	}
	if st, _ := os.Stat(filepath.Dir(s.Path())); st.Mode().Perm() != 0o755 {
		t.Errorf("socket directory mode %v, want 0755", st.Mode().Perm())
	}
	ctx := context.Background()
	resp, err := admin.Do(ctx, s.Path(), admin.Request{Command: admin.CmdList})
	if err != nil || len(resp.Exports) != 1 || resp.Exports[0].Name != "vol" {
		t.Fatalf("list: %+v, %v", resp, err)
	}
	_, err = admin.Do(ctx, s.Path(), admin.Request{Command: admin.CmdRemove, Name: "x"})
	if !errors.Is(err, admin.ErrFailed) || !strings.Contains(err.Error(), "no such export") {
		t.Fatalf("remove: %v, want ErrFailed with the reason", err)
	}
}

// TestMalformed: garbage, unknown fields and a client that sends nothing
// get an error reply (or are dropped at the deadline) and the server goes
// on serving.
func TestMalformed(t *testing.T) {
	var calls atomic.Int32
	s := listen(t, &calls)
	for _, in := range []string{"not json\n", `{"command":"list","bogus":1}` + "\n", `{"command":` + "\n"} {
		c, err := net.Dial("unix", s.Path())
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(in))
		c.(*net.UnixConn).CloseWrite()
		var resp admin.Response
		if err := json.NewDecoder(c).Decode(&resp); err != nil || resp.OK || !strings.Contains(resp.Error, "malformed request") {
			t.Errorf("%q: %+v, %v; want a malformed request error", in, resp, err)
		}
		c.Close()
	}
	if calls.Load() != 0 {
		t.Fatalf("the handler saw %d malformed requests", calls.Load())
	}
	if _, err := admin.Do(context.Background(), s.Path(), admin.Request{Command: admin.CmdList}); err != nil {
		t.Fatalf("list after malformed requests: %v", err)
	}
}

// TestStaleAndInUse: a socket left by a dead process is replaced; one a
// live server listens on is refused.
func TestStaleAndInUse(t *testing.T) {
	var calls atomic.Int32
	s := listen(t, &calls)
	if _, err := admin.Listen(s.Path(), nil, admin.ServerOptions{}); !errors.Is(err, admin.ErrInUse) {
		t.Fatalf("second Listen: %v, want ErrInUse", err)
	}
	stale := filepath.Join(filepath.Dir(s.Path()), "stale.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	s2, err := admin.Listen(stale, func(context.Context, admin.Request) admin.Response { return admin.Response{OK: true} }, admin.ServerOptions{})
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	defer s2.Close()
	if _, err := admin.Do(context.Background(), stale, admin.Request{Command: admin.CmdList}); err != nil {
		t.Fatal(err)
	}
}

// TestInUseWithoutLock: a live socket of a process that does not take the
// lock file (an rblkd of before it) is refused, and keeps answering;
// anything but a socket at the path is refused and left alone; so is a
// lock file that is not a regular file.
func TestInUseWithoutLock(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	dir := t.TempDir()
	live := filepath.Join(dir, "live.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: live, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := admin.Listen(live, nil, admin.ServerOptions{}); !errors.Is(err, admin.ErrInUse) || !strings.Contains(err.Error(), "it answers") {
		t.Fatalf("Listen over a live socket without its lock: %v, want ErrInUse saying it answers", err)
	}
	if c, err := net.Dial("unix", live); err != nil {
		t.Fatalf("the live socket after the refused Listen: %v", err)
	} else {
		c.Close()
	}

	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Listen(file, nil, admin.ServerOptions{}); err == nil || errors.Is(err, admin.ErrInUse) || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Listen over a regular file: %v, want it refused as not a socket", err)
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "x" {
		t.Fatalf("the regular file after the refused Listen: %q, %v", b, err)
	}

	fifo := filepath.Join(dir, "fifo.sock")
	if err := syscall.Mkfifo(fifo+admin.LockSuffix, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Listen(fifo, nil, admin.ServerOptions{}); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("Listen with a FIFO as its lock file: %v, want it refused", err)
	}
	link := filepath.Join(dir, "link.sock")
	if err := os.Symlink(file, link+admin.LockSuffix); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Listen(link, nil, admin.ServerOptions{}); err == nil || !errors.Is(err, syscall.ELOOP) {
		t.Fatalf("Listen with a symbolic link as its lock file: %v, want ELOOP", err)
	}
}

// TestListenAtOnce: two Listens of one path at once. The first is held
// (by the test's hook) between taking the path and binding the socket,
// the race's window; the second, meanwhile, is refused at once with
// ErrInUse, and the first then binds and serves. Then, with the path
// free again (Close), a third gets it. The same over a stale socket left
// by a process that died: whoever holds the path replaces it, the other
// neither removes the first's socket nor binds its own.
func TestListenAtOnce(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	ok := func(context.Context, admin.Request) admin.Response { return admin.Response{OK: true} }
	for _, stale := range []bool{false, true} {
		dir := t.TempDir()
		path := filepath.Join(dir, "rblkd.sock")
		if stale {
			l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
			if err != nil {
				t.Fatal(err)
			}
			l.SetUnlinkOnClose(false)
			l.Close()
		}
		var held atomic.Bool
		inWindow, release := make(chan struct{}), make(chan struct{})
		restore := admin.SetListenHook(func(p, stage string) {
			if p == path && held.CompareAndSwap(false, true) {
				close(inWindow)
				<-release
			}
		})
		type result struct {
			s   *admin.Server
			err error
		}
		first := make(chan result, 1)
		go func() {
			s, err := admin.Listen(path, ok, admin.ServerOptions{})
			first <- result{s, err}
		}()
		<-inWindow
		second := make(chan result, 1)
		go func() {
			s, err := admin.Listen(path, ok, admin.ServerOptions{})
			second <- result{s, err}
		}()
		var r2 result
		select {
		case r2 = <-second:
		case <-time.After(30 * time.Second):
			close(release)
			t.Fatalf("stale %v: the second Listen waits for the first", stale)
		}
		close(release)
		r1 := <-first
		restore()
		if r2.err == nil {
			r2.s.Close()
		}
		if r1.err != nil {
			t.Fatalf("stale %v: the first Listen, held in its window: %v", stale, r1.err)
		}
		if !errors.Is(r2.err, admin.ErrInUse) || !strings.Contains(r2.err.Error(), path) {
			t.Errorf("stale %v: the second Listen, during the first's: %v, want ErrInUse naming %s", stale, r2.err, path)
		}
		if _, err := admin.Do(context.Background(), path, admin.Request{Command: admin.CmdList}); err != nil {
			t.Errorf("stale %v: the first's socket: %v", stale, err)
		}
		if _, err := admin.Listen(path, ok, admin.ServerOptions{}); !errors.Is(err, admin.ErrInUse) {
			t.Errorf("stale %v: a Listen while the first serves: %v, want ErrInUse", stale, err)
		}
		r1.s.Close()
		r1.s.Close() // safe twice
		if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("stale %v: the socket after Close: %v, want it removed", stale, err)
		}
		s3, err := admin.Listen(path, ok, admin.ServerOptions{})
		if err != nil {
			t.Fatalf("stale %v: Listen after the first closed: %v", stale, err)
		}
		if _, err := admin.Do(context.Background(), path, admin.Request{Command: admin.CmdList}); err != nil {
			t.Errorf("stale %v: the third's socket: %v", stale, err)
		}
		s3.Close()
	}
}

// TestNonRootRefused: a process of another user (this test's thread with
// its user switched) is refused by the peer check, even when the socket's
// mode lets it connect; the handler never runs.
func TestNonRootRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to switch a thread to another user")
	}
	var calls atomic.Int32
	s := listen(t, &calls)
	for _, p := range []string{filepath.Dir(filepath.Dir(s.Path())), filepath.Dir(s.Path())} {
		os.Chmod(p, 0o755)
	}
	os.Chmod(s.Path(), 0o666) // only the peer check is left to refuse
	type result struct {
		resp admin.Response
		err  error
	}
	done := make(chan result, 1)
	go func() {
		// The thread connects as uid 65534 and is never used again (not
		// unlocked: it exits with the goroutine).
		runtime.LockOSThread()
		if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, 65534, 65534, 0); e != 0 {
			done <- result{err: e}
			return
		}
		c, err := net.Dial("unix", s.Path())
		syscall.RawSyscall(syscall.SYS_SETRESUID, 0, 0, 0)
		if err != nil {
			done <- result{err: err}
			return
		}
		defer c.Close()
		json.NewEncoder(c).Encode(admin.Request{Command: admin.CmdList})
		var r result
		r.err = json.NewDecoder(c).Decode(&r.resp)
		done <- r
	}()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.resp.OK || !strings.Contains(r.resp.Error, "permission denied: uid 65534") {
		t.Fatalf("non-root peer got %+v, want permission denied", r.resp)
	}
	if calls.Load() != 0 {
		t.Fatal("the handler ran for a non-root peer")
	}
	if !admin.Allowed(0, 1000) || !admin.Allowed(1000, 1000) || admin.Allowed(1001, 1000) {
		t.Fatal("Allowed")
	}
}
