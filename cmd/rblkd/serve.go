package main

import (
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/rblk/rblk/admin"
	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/manage"
	"github.com/rblk/rblk/manage/remote"
	"github.com/rblk/rblk/pool"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/providers"
)

// DefaultListen is rblkd's default address: every interface, port 7480;
// DefaultLoopbackListen is the default without authentication.
const (
	DefaultListen         = ":7480"
	DefaultLoopbackListen = "127.0.0.1:7480"
)

// listenAddr picks the address to listen on. Without authentication it
// must be a loopback address (or a unix socket's path), unless
// allowUnauthenticated: secure by default, like Redis' protected mode.
func listenAddr(listen string, authenticated, allowUnauthenticated bool) (string, error) {
	if authenticated || allowUnauthenticated {
		if listen == "" {
			listen = DefaultListen
		}
		return listen, nil
	}
	if listen == "" {
		return DefaultLoopbackListen, nil
	}
	if !isLoopback(listen) {
		return "", fmt.Errorf("--listen %s is not a loopback address, and rblkd has no --auth-file: anyone who reaches it could open every export. "+
			"Give --auth-file (see README, Security), or --allow-unauthenticated on a network you trust", listen)
	}
	return listen, nil
}

// isLoopback reports whether addr (HOST:PORT, or a unix socket's path)
// can only be reached from this host.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return !strings.Contains(addr, ":") // a unix socket's path; a bad address fails in Listen
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "rblkd",
		Short:         "rblk storage target: exports volumes over RDMA",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newServeCmd(), newExportCmd(), newVolumeCmd(), newCertCmd(), newDoctorCmd(), cli.GenDocsCmd(root))
	return root
}

type serveFlags struct {
	listen, transport, metrics, logFormat string
	exports                               []string
	cacheSize, chunkSize                  string
	debug, pprof                          bool
	authFile, targetID                    string
	allowUnauthenticated                  bool
	maxSessions, maxSessionsPerHost       int
	maxUnauthenticated, maxHandles        int
	handshakeTimeout                      time.Duration

	keepAlive, revokeTimeout, drainTimeout, drainLimit time.Duration

	config, adminSocket string
	file                fileState // what --config gave (config.go)
}

func newServeCmd() *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve [--config FILE] [--export NAME=PATH[,ro][,size=BYTES][,shared][,allow=ID1:ID2] ...]",
		Short: "Serve volumes until SIGINT or SIGTERM",
		Long: `Serve exports backing files (regular files or block devices) as volumes.

Chunks of each volume are cached in rblkd's own registered memory (bounded by
--cache-size) and granted to initiators, which read and write them with
one-sided RDMA; rblkd writes dirty ranges back, flushes and trims.
With --auth-file every initiator proves its host's secret (and rblkd proves it
back) before it may list or open anything. Without it rblkd serves only on
loopback addresses, unless --allow-unauthenticated. RDMA payloads are never
encrypted: use a storage network you trust.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := loadConfig(cmd, &f); err != nil {
				return err
			}
			return serve(f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.listen, "listen", "", "address to accept initiators on, HOST:PORT (default "+DefaultListen+
		", or "+DefaultLoopbackListen+" without --auth-file and --allow-unauthenticated)")
	fl.StringVar(&f.authFile, "auth-file", "", "file of \"HOST-ID SECRET\" lines (mode 0600): every initiator must authenticate")
	fl.BoolVar(&f.allowUnauthenticated, "allow-unauthenticated", false, "serve non-loopback addresses without --auth-file: anyone who reaches the port may open every export")
	fl.StringVar(&f.targetID, "target-id", "", "this target's name in the authentication (default: the host name)")
	fl.IntVar(&f.maxSessions, "max-sessions", target.DefaultMaxSessions, "most initiator sessions at once")
	fl.IntVar(&f.maxSessionsPerHost, "max-sessions-per-host", target.DefaultMaxSessionsPerHost, "most sessions of one host ID at once")
	fl.IntVar(&f.maxUnauthenticated, "max-unauthenticated", target.DefaultMaxUnauthenticated,
		"most connections waiting to authenticate, apart from --max-sessions (more from the address that holds the most are refused at once)")
	fl.DurationVar(&f.handshakeTimeout, "handshake-timeout", target.DefaultHandshakeTimeout, "close a connection that has not authenticated this long after it connected")
	fl.IntVar(&f.maxHandles, "max-handles-per-session", target.DefaultMaxHandlesPerSession, "most volumes one session has open at once")
	fl.StringVar(&f.transport, "transport", "auto", "transport: "+providers.Names)
	fl.StringArrayVar(&f.exports, "export", nil, "export NAME=PATH[,ro][,size=BYTES][,shared][,allow=ID1:ID2] (repeatable; size= creates a sparse file "+
		"if PATH does not exist; shared: several hosts may write at once; allow=: only these host IDs)")
	fl.StringVar(&f.cacheSize, "cache-size", "256M", "registered memory for cached chunks (K, M, G suffixes)")
	fl.StringVar(&f.chunkSize, "chunk-size", "1M", "unit of caching and granting, a power of two from 64K")
	fl.DurationVar(&f.keepAlive, "keepalive-timeout", target.DefaultKeepAlive,
		"drop a session whose initiator is silent this long (probed after a third of it; 0: never)")
	fl.DurationVar(&f.revokeTimeout, "revoke-timeout", target.DefaultRevokeTimeout,
		"close the session of an initiator that does not give a chunk back this long (every initiator gets all of it)")
	fl.DurationVar(&f.drainTimeout, "drain-timeout", target.DefaultDrainTimeout,
		"on SIGTERM, wait for initiators to flush and leave while they make progress; give up after this long without any")
	fl.DurationVar(&f.drainLimit, "drain-limit", target.DefaultDrainLimit, "on SIGTERM, wait at most this long in all")
	fl.StringVar(&f.metrics, "metrics-listen", "", "serve Prometheus /metrics on HOST:PORT")
	fl.StringVar(&f.logFormat, "log-format", "console", "log format: console or json")
	fl.BoolVar(&f.debug, "debug", false, "debug logs")
	fl.BoolVar(&f.pprof, "debug-pprof", false, "also serve Go's profiles (CPU, heap, mutex, block, trace) at /debug/pprof/ on --metrics-listen")
	fl.StringVar(&f.config, "config", "", "configuration file (YAML, see README): its settings and exports; flags given here override it; SIGHUP reloads it")
	fl.StringVar(&f.adminSocket, "admin-socket", admin.DefaultSocket, "PATH of the admin socket that rblkd export uses (root only; \"\": none)")
	return cmd
}

// parseExports parses --export flags.
func parseExports(flags []string) ([]target.ExportConfig, error) {
	var out []target.ExportConfig
	for _, s := range flags {
		e, err := target.ParseExport(s)
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

func serve(f serveFlags) error {
	if err := cli.CheckMetricsOptions(f.metrics, cli.MetricsOptions{Profiling: f.pprof}); err != nil {
		return err
	}
	flagExports, err := parseExports(f.exports)
	if err != nil {
		return err
	}
	exports := mergeExports(f.file.fileExports, flagExports)
	if len(exports) == 0 && len(f.file.pools) == 0 {
		return fmt.Errorf("no --export given (nor exports: or pools: in --config): want at least one NAME=PATH[,ro][,size=BYTES]")
	}
	if err := checkNamespaces(exports, f.file.pools); err != nil {
		return err
	}
	cacheSize, err := target.ParseSize(f.cacheSize)
	if err != nil {
		return fmt.Errorf("--cache-size: %w", err)
	}
	chunkSize, err := target.ParseSize(f.chunkSize)
	if err != nil {
		return fmt.Errorf("--chunk-size: %w", err)
	}
	var keys *auth.Keys
	if f.authFile != "" {
		if keys, err = auth.LoadKeys(f.authFile); err != nil {
			return fmt.Errorf("--auth-file: %w", err)
		}
	}
	listen, err := listenAddr(f.listen, keys != nil, f.allowUnauthenticated)
	if err != nil {
		return err
	}
	log, err := cli.NewLogger(f.logFormat, f.debug)
	if err != nil {
		return err
	}
	defer log.Sync()
	switch {
	case keys != nil:
		log.Info("authentication required", zap.String("auth_file", f.authFile), zap.Int("hosts", keys.Len()))
	case f.allowUnauthenticated:
		log.Warn("serving WITHOUT authentication (--allow-unauthenticated): anyone who reaches " + listen +
			" may list, open and write every export not limited by allow=")
	}
	p, why, err := providers.Open(f.transport, log)
	if err != nil {
		return err
	}
	ctx, cancel := cli.SignalContext()
	defer cancel()
	reg := cli.NewRegistry()
	keepAlive := f.keepAlive
	if keepAlive == 0 {
		keepAlive = -1 // the flag's 0 is "never"; the option's is "default"
	}
	t, err := target.New(target.Options{Exports: exports, CacheSize: cacheSize, ChunkSize: int(chunkSize),
		KeepAlive: keepAlive, RevokeTimeout: f.revokeTimeout, DrainTimeout: f.drainTimeout, DrainLimit: f.drainLimit,
		Auth: keys, TargetID: f.targetID, MaxSessions: f.maxSessions, MaxSessionsPerHost: f.maxSessionsPerHost,
		MaxUnauthenticated: f.maxUnauthenticated, MaxHandlesPerSession: f.maxHandles,
		HandshakeTimeout: f.handshakeTimeout, Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	pools, err := openPools(f.file.pools, log)
	if err != nil {
		t.Close()
		return err
	}
	defer func() {
		for _, p := range pools {
			p.Close()
		}
	}()
	var svc *manage.Service
	if len(pools) > 0 {
		mo := manage.Options{Logger: log}
		if keys != nil {
			mo.KnownHost = func(h string) bool { _, ok := keys.Secret(h); return ok }
		}
		if svc, err = manage.New(ctx, t, pools, mo); err != nil {
			t.Close()
			return err
		}
		if err := reg.Register(svc.Collector()); err != nil {
			t.Close()
			return fmt.Errorf("register the pools' metrics: %w", err)
		}
	}
	var api *remote.Server
	if m := f.file.management; m != nil {
		opts := remote.Options{Listen: m.Listen, CertFile: m.Cert, KeyFile: m.Key, ClientCAFile: m.ClientCA, Logger: log, Registerer: reg}
		for _, c := range m.Clients {
			opts.Clients = append(opts.Clients, remote.Client{Identity: c.Identity, Pools: c.Pools})
		}
		if api, err = remote.Listen(svc, opts); err != nil {
			t.Close()
			return err
		}
		defer api.Close()
		log.Info("management API", zap.String("listen", api.Addr()), zap.Int("clients", len(opts.Clients)))
	}
	stopMetrics, err := cli.MetricsServer(ctx, f.metrics, reg, log, cli.MetricsOptions{Profiling: f.pprof})
	if err != nil {
		if api != nil {
			api.Close()
		}
		t.Close()
		return err
	}
	defer stopMetrics()
	l, err := p.Listen(ctx, listen)
	if err != nil {
		t.Close()
		return fmt.Errorf("--listen %s: %w", listen, err)
	}
	if di, ok := l.(interface{ DeviceInfo() string }); ok {
		why += ": " + di.DeviceInfo() // device, port, GID
	}
	log.Info("rblkd serving", zap.String("listen", l.Addr()), zap.String("transport", why),
		zap.Int64("cache_size", cacheSize), zap.Int64("chunk_size", chunkSize))
	d, err := startDaemon(ctx, t, svc, f, flagExports, reg, log)
	if err != nil {
		l.Close()
		t.Close()
		return err
	}
	// Listening, /metrics and the admin socket up: systemd may start what
	// depends on rblkd.
	defer cli.NotifyReady(ctx, log, fmt.Sprintf("serving %d exports on %s", len(t.Exports()), l.Addr()))()
	serveErr := t.Serve(ctx, l)
	if api != nil {
		api.Close() // (before the target: no request may change it while it closes)
	}
	d.stop()
	log.Info("stopping: writing back and syncing every volume")
	closeErr := t.Close()
	if serveErr != nil {
		return serveErr
	}
	if closeErr != nil {
		return fmt.Errorf("close: %w", closeErr)
	}
	log.Info("stopped cleanly")
	return nil
}

// openPools opens the configured pools (each locks its directory: two
// rblkd never share a pool).
func openPools(cfgs []config.Pool, log *zap.Logger) ([]*pool.Pool, error) {
	var out []*pool.Pool
	for _, c := range cfgs {
		p, err := pool.Open(pool.Config{Name: c.Name, Dir: c.Directory, Capacity: c.Capacity, Labels: c.Labels, Logger: log})
		if err != nil {
			for _, o := range out {
				o.Close()
			}
			return nil, err
		}
		pc, err := p.Capacity()
		if err != nil {
			p.Close()
			for _, o := range out {
				o.Close()
			}
			return nil, err
		}
		log.Info("pool", zap.String("pool", c.Name), zap.String("directory", c.Directory), zap.Int("volumes", pc.Volumes),
			zap.Int64("capacity", pc.Limit), zap.Int64("provisioned", pc.Provisioned), zap.Int64("available", pc.Available))
		out = append(out, p)
	}
	return out, nil
}
