package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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

// TestMetricsServerProfiling: /debug/pprof/ is served with Profiling and
// only then, never the command line; Profiling without an address is
// refused.
func TestMetricsServerProfiling(t *testing.T) {
	if err := CheckMetricsOptions("", MetricsOptions{Profiling: true}); !errors.Is(err, ErrProfilingNeedsMetrics) {
		t.Fatalf("profiling without an address: %v, want ErrProfilingNeedsMetrics", err)
	}
	if _, err := MetricsServer(context.Background(), "", prometheus.NewRegistry(), zap.NewNop(), MetricsOptions{Profiling: true}); !errors.Is(err, ErrProfilingNeedsMetrics) {
		t.Fatalf("MetricsServer, profiling without an address: %v, want ErrProfilingNeedsMetrics", err)
	}
	for _, tc := range []struct {
		profiling bool
		want      map[string]int
	}{
		{false, map[string]int{"/metrics": 200, "/debug/pprof/": 404, "/debug/pprof/goroutine?debug=1": 404}},
		{true, map[string]int{"/metrics": 200, "/debug/pprof/": 200, "/debug/pprof/goroutine?debug=1": 200,
			"/debug/pprof/profile?seconds=1": 200, "/debug/pprof/cmdline": 404}},
	} {
		t.Run(fmt.Sprintf("profiling=%v", tc.profiling), func(t *testing.T) {
			// A port picked here and freed: MetricsServer binds it again.
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			addr := ln.Addr().String()
			ln.Close()
			stop, err := MetricsServer(context.Background(), addr, prometheus.NewRegistry(), zap.NewNop(), MetricsOptions{Profiling: tc.profiling})
			if err != nil {
				t.Fatal(err)
			}
			defer stop()
			for path, code := range tc.want {
				resp, err := http.Get("http://" + addr + path)
				if err != nil {
					t.Fatalf("GET %s: %v", path, err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != code {
					t.Errorf("GET %s: %d, want %d", path, resp.StatusCode, code)
				}
				if code == 200 && len(body) == 0 {
					t.Errorf("GET %s: empty body", path)
				}
			}
		})
	}
}
