package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/providers"
)

// DefaultListen is rblkd's default address: every interface, port 7480.
const DefaultListen = ":7480"

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "rblkd",
		Short:         "rblk storage target: exports volumes over RDMA",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newServeCmd())
	return root
}

type serveFlags struct {
	listen, transport, metrics, logFormat string
	exports                               []string
	cacheSize, chunkSize                  string
	debug                                 bool

	keepAlive, revokeTimeout, drainTimeout, drainLimit time.Duration
}

func newServeCmd() *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve --export NAME=PATH[,ro][,size=BYTES] ...",
		Short: "Serve volumes until SIGINT or SIGTERM",
		Long: `Serve exports backing files (regular files or block devices) as volumes.

Chunks of each volume are cached in rblkd's own registered memory (bounded by
--cache-size) and granted to initiators, which read and write them with
one-sided RDMA; rblkd writes dirty ranges back, flushes and trims.
There is no authentication: listen only on a storage network you trust.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return serve(f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.listen, "listen", DefaultListen, "address to accept initiators on (HOST:PORT)")
	fl.StringVar(&f.transport, "transport", "auto", "transport: "+providers.Names)
	fl.StringArrayVar(&f.exports, "export", nil, "export NAME=PATH[,ro][,size=BYTES] (repeatable; size= creates a sparse file if PATH does not exist)")
	fl.StringVar(&f.cacheSize, "cache-size", "256M", "registered memory for cached chunks (K, M, G suffixes)")
	fl.StringVar(&f.chunkSize, "chunk-size", "1M", "unit of caching and granting, a power of two from 64K")
	fl.DurationVar(&f.keepAlive, "keepalive-timeout", target.DefaultKeepAlive,
		"drop a session whose initiator is silent this long (probed after a third of it; 0: never)")
	fl.DurationVar(&f.revokeTimeout, "revoke-timeout", target.DefaultRevokeTimeout,
		"close the session of an initiator that does not give a chunk back this long (a tenth of it for one holding more than its share of the cache)")
	fl.DurationVar(&f.drainTimeout, "drain-timeout", target.DefaultDrainTimeout,
		"on SIGTERM, wait for initiators to flush and leave while they make progress; give up after this long without any")
	fl.DurationVar(&f.drainLimit, "drain-limit", target.DefaultDrainLimit, "on SIGTERM, wait at most this long in all")
	fl.StringVar(&f.metrics, "metrics-listen", "", "serve Prometheus /metrics on HOST:PORT")
	fl.StringVar(&f.logFormat, "log-format", "console", "log format: console or json")
	fl.BoolVar(&f.debug, "debug", false, "debug logs")
	return cmd
}

func serve(f serveFlags) error {
	if len(f.exports) == 0 {
		return fmt.Errorf("no --export given: want at least one NAME=PATH[,ro][,size=BYTES]")
	}
	var exports []target.ExportConfig
	for _, s := range f.exports {
		e, err := target.ParseExport(s)
		if err != nil {
			return err
		}
		exports = append(exports, e)
	}
	cacheSize, err := target.ParseSize(f.cacheSize)
	if err != nil {
		return fmt.Errorf("--cache-size: %w", err)
	}
	chunkSize, err := target.ParseSize(f.chunkSize)
	if err != nil {
		return fmt.Errorf("--chunk-size: %w", err)
	}
	log, err := cli.NewLogger(f.logFormat, f.debug)
	if err != nil {
		return err
	}
	defer log.Sync()
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
		Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	stopMetrics, err := cli.MetricsServer(ctx, f.metrics, reg, log)
	if err != nil {
		t.Close()
		return err
	}
	defer stopMetrics()
	l, err := p.Listen(ctx, f.listen)
	if err != nil {
		t.Close()
		return fmt.Errorf("--listen %s: %w", f.listen, err)
	}
	if di, ok := l.(interface{ DeviceInfo() string }); ok {
		why += ": " + di.DeviceInfo() // device, port, GID
	}
	log.Info("rblkd serving", zap.String("listen", l.Addr()), zap.String("transport", why),
		zap.Int64("cache_size", cacheSize), zap.Int64("chunk_size", chunkSize))
	serveErr := t.Serve(ctx, l)
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
