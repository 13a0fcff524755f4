package cli

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
)

// TestHostIDFile: the host ID is read from its file; a file that is a FIFO
// is refused at once (read as before, it would wait for a writer for
// ever), naming the path; a missing file is created with a random ID.
func TestHostIDFile(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "hostid")
	if err := os.WriteFile(file, []byte("db-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if id, err := HostID("", file, zap.NewNop()); err != nil || id != "db-1" {
		t.Errorf("HostID from a file: %q, %v", id, err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := HostID("", fifo, zap.NewNop())
		done <- err
	}()
	select {
	case err := <-done:
		if want := "host ID file: " + fifo + " is a FIFO: want a regular file"; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("HostID of a FIFO: %v, want %q", err, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("HostID of a FIFO blocked")
	}
	created := filepath.Join(dir, "new", "hostid")
	id, err := HostID("", created, zap.NewNop())
	if b, rerr := os.ReadFile(created); err != nil || rerr != nil || strings.TrimSpace(string(b)) != id {
		t.Errorf("HostID of a missing file: %q, %v; file %q, %v", id, err, b, rerr)
	}
}
