// Package cli holds what rblkd and rblk-attach share: the logger, the
// metrics endpoint, and signal handling.
package cli

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/rblk/rblk/internal/rdmacounters"
	"github.com/rblk/rblk/internal/safeopen"
)

// NewLogger logs to stderr: "console" for people, "json" for collectors.
func NewLogger(format string, debug bool) (*zap.Logger, error) {
	cfg := zap.NewProductionConfig()
	cfg.Sampling = nil
	cfg.OutputPaths = []string{"stderr"}
	cfg.ErrorOutputPaths = []string{"stderr"}
	cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	cfg.DisableStacktrace = true
	switch format {
	case "console":
		cfg.Encoding = "console"
		cfg.EncoderConfig.EncodeLevel = zapcore.CapitalLevelEncoder
	case "json":
	default:
		return nil, fmt.Errorf("--log-format %q: want console or json", format)
	}
	if debug {
		cfg.Level = zap.NewAtomicLevelAt(zap.DebugLevel)
	}
	return cfg.Build()
}

// SysfsEnv names the environment variable that moves the sysfs root the
// RDMA counters are read from (default /sys): a container that mounts the
// host's /sys elsewhere sets it.
const SysfsEnv = "RBLK_SYSFS"

// NewRegistry is a metrics registry with the Go and process collectors and
// the RDMA devices' counters (package rdmacounters, under $RBLK_SYSFS or
// /sys).
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		rdmacounters.New(os.Getenv(SysfsEnv)))
	return reg
}

// ErrProfilingNeedsMetrics: profiles were asked for without a metrics
// address to serve them on.
var ErrProfilingNeedsMetrics = errors.New("--debug-pprof needs --metrics-listen: the profiles are served beside /metrics")

// MetricsOptions says what MetricsServer serves beside /metrics.
type MetricsOptions struct {
	// Profiling also serves Go's runtime profiles (CPU, heap, goroutines,
	// mutex and block contention, execution trace) at /debug/pprof/, as
	// net/http/pprof does: `go tool pprof http://ADDR/debug/pprof/profile`.
	// A CPU profile or trace costs CPU while it runs; nothing is sampled
	// otherwise, apart from mutex contention (one event in
	// MutexProfileFraction) and blocking (one per BlockProfileRate of time
	// blocked), which Profiling turns on. The command line
	// (/debug/pprof/cmdline) is not served.
	Profiling bool
}

// The sampling of contention that MetricsOptions.Profiling turns on.
const (
	MutexProfileFraction = 100
	BlockProfileRate     = 100 * time.Microsecond
)

// CheckMetricsOptions refuses options that need a metrics address when
// addr is empty.
func CheckMetricsOptions(addr string, opts MetricsOptions) error {
	if opts.Profiling && addr == "" {
		return ErrProfilingNeedsMetrics
	}
	return nil
}

// MetricsServer serves /metrics of reg on addr until ctx ends, and what
// opts adds. It binds before returning, so a port in use is reported at
// once. An empty addr serves nothing (CheckMetricsOptions refuses opts
// that need one).
func MetricsServer(ctx context.Context, addr string, reg *prometheus.Registry, log *zap.Logger, opts MetricsOptions) (stop func(), err error) {
	if err := CheckMetricsOptions(addr, opts); err != nil {
		return nil, err
	}
	if addr == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-listen %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	if opts.Profiling {
		runtime.SetMutexProfileFraction(MutexProfileFraction)
		runtime.SetBlockProfileRate(int(BlockProfileRate))
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		mux.HandleFunc("/debug/pprof/cmdline", http.NotFound)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server", zap.Error(err))
		}
	}()
	log.Info("metrics", zap.String("url", "http://"+ln.Addr().String()+"/metrics"), zap.Bool("pprof", opts.Profiling))
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			srv.Close() // a CPU profile or trace still running
		}
		<-done
	}, nil
}

// SignalContext ends on SIGINT or SIGTERM.
func SignalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

// DefaultHostIDFile holds this host's stable identity, like nvme-cli's
// /etc/nvme/hostnqn.
const DefaultHostIDFile = "/etc/rblk/hostid"

// HostID returns the host ID to use: id if not empty, else the one in
// file, which is created with a random UUID when it does not exist. When
// the file cannot be read or created, it says why and returns a random ID
// for this process only (so reconnects still fence the earlier session,
// but a restart is not recognized as the same host). A file that is not a
// regular file (a FIFO, a socket, a device) is an error, said at once.
func HostID(id, file string, log *zap.Logger) (string, error) {
	if id != "" {
		return id, checkHostID(id)
	}
	b, _, err := safeopen.ReadFile(file, 64<<10)
	if errors.Is(err, safeopen.ErrKind) {
		// A FIFO, socket or device there is a mistake to fix, not a file
		// that cannot be read: refused at once (never waited on).
		return "", fmt.Errorf("host ID file: %w (give --host-id, or remove it: the next attach writes a random UUID)", err)
	}
	if err == nil {
		id = strings.TrimSpace(string(b))
		if err := checkHostID(id); err != nil {
			return "", fmt.Errorf("host ID in %s: %w", file, err)
		}
		return id, nil
	}
	id = randomUUID()
	if !errors.Is(err, fs.ErrNotExist) {
		log.Warn("cannot read the host ID file: using a random host ID for this run (give --host-id)", zap.String("file", file), zap.Error(err))
		return id, nil
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err == nil {
		err = os.WriteFile(file, []byte(id+"\n"), 0o644)
		if err == nil {
			log.Info("created this host's ID", zap.String("file", file), zap.String("host_id", id))
			return id, nil
		}
	}
	log.Warn("cannot create the host ID file: using a random host ID for this run (give --host-id)", zap.String("file", file), zap.Error(err))
	return id, nil
}

func checkHostID(id string) error {
	switch {
	case id == "":
		return errors.New("empty host ID")
	case len(id) > 255:
		return fmt.Errorf("host ID of %d bytes, more than 255", len(id))
	case !utf8.ValidString(id) || strings.ContainsAny(id, "\x00\n"):
		return fmt.Errorf("host ID %q: want printable UTF-8", id)
	}
	return nil
}

// randomUUID returns a random (version 4) UUID.
func randomUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}
