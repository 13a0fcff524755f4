package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/kernel"
	"github.com/rblk/rblk/initiator/nbd"
	"github.com/rblk/rblk/initiator/ublk"
	"github.com/rblk/rblk/internal/attachstate"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport/providers"
)

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "rblk-attach",
		Short:         "Attach rblk volumes on this host",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newAttachCmd(), newDetachCmd(), newListCmd(), newStatusCmd(), newDoctorCmd(), newUdevIDCmd(), cli.GenDocsCmd(root))
	return root
}

type attachFlags struct {
	target, export, transport, nbdListen, metrics, logFormat string
	hostID, hostIDFile, secretFile                           string
	stateDir                                                 string
	readOnly, debug, pprof, takeover, failOnLostWrites       bool
	reconnectTimeout, keepAlive, ioTimeout, flushTimeout     time.Duration
	fastFailTimeout, restartGrace                            time.Duration
	queues                                                   int
	dev                                                      deviceFlags // --device: see device.go

	state *stateFile // this attach's status file (status.go); not a flag
}

func newAttachCmd() *cobra.Command {
	var f attachFlags
	cmd := &cobra.Command{
		Use:   "attach --target HOST:PORT --export NAME (--nbd-listen unix:PATH|tcp:HOST:PORT | --device /dev/nbdN|auto|ublk|/dev/ublkbN)",
		Short: "Attach a volume and serve it over NBD, or as /dev/nbdN, until SIGINT or SIGTERM",
		Long: `Attach opens a volume on an rblk target and serves it as an NBD export,
by the volume's name and as the default export. Reads are one-sided RDMA READs
from the target's memory, writes RDMA WRITEs followed by a Done message.
On SIGINT or SIGTERM it stops taking NBD requests, finishes those in flight,
flushes the volume and detaches.

With --device it attaches the volume to this host's kernel as /dev/nbdN instead
(root, and the nbd module: modprobe nbd). On SIGINT or SIGTERM it disconnects
the device first (the kernel fails what is still in flight on it: unmount
first); 'rblk-attach detach /dev/nbdN' makes it flush, close and exit 0.

With --device ublk (or /dev/ublkbN) it attaches as /dev/ublkbN through the
kernel's ublk driver (Linux >= 6.0, modprobe ublk_drv): one io_uring queue per
CPU (--connections sets how many), same lifecycle.

Each attach has an instance, a random number made at start and kept across
its reconnects, beside the host ID (rblk-attach status shows both). rblkd
reinstates the same attach coming back (its reconnect fences its earlier
session), but refuses a read-write attach of an export that another live
attach of this host holds, naming it (since when, from where, its instance):
detach that one first, attach read-only, or give --takeover. An attach whose
holder no longer answers (its host crashed or hangs) gets in without
--takeover once rblkd's liveness check of the holder went unanswered.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return attach(f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.target, "target", "", "rblkd address HOST:PORT (required)")
	fl.StringVar(&f.export, "export", "", "volume name (required)")
	fl.StringVar(&f.transport, "transport", "auto", "transport: "+providers.Names)
	fl.StringVar(&f.nbdListen, "nbd-listen", "", "serve NBD on unix:PATH or tcp:HOST:PORT (this or --device)")
	f.dev.register(fl)
	fl.IntVar(&f.queues, "queues", 0, "connections to the target, each an IO queue of the session with its own completion path; NBD connection i is served by queue i (0: as many as the device's --connections, 1 with --nbd-listen)")
	fl.BoolVar(&f.readOnly, "read-only", false, "attach read-only")
	fl.DurationVar(&f.reconnectTimeout, "reconnect-timeout", initiator.DefaultReconnectTimeout,
		"how long IO waits for the target to come back after the connection is lost (0: fail at once)")
	fl.DurationVar(&f.fastFailTimeout, "fast-fail-timeout", 0,
		"after the connection is lost, how long IO waits before it fails with EIO while rblk-attach goes on reconnecting for --reconnect-timeout; once the target is back IO is served again (0: IO waits as long as the reconnect; for a mirror member, a few seconds)")
	fl.DurationVar(&f.restartGrace, "restart-grace", 0,
		"with --fast-fail-timeout: after a planned shutdown of the target (it drained this attach: an rblkd restarted with SIGTERM), how long IO waits for it before it fails fast (0: --fast-fail-timeout), so that a planned restart degrades no mirror")
	fl.BoolVar(&f.failOnLostWrites, "fail-on-lost-writes", false,
		"when the target came back as another instance (a restart) and writes acknowledged since the last flush may be lost, fail every IO and detach, instead of failing the next flush once: a mirror takes the member out and resyncs it")
	fl.StringVar(&f.hostID, "host-id", "", "this host's identity: a reconnect of this attach fences its earlier session; another attach of the export with it is refused while this one lives (default: read "+cli.DefaultHostIDFile+", created on first use)")
	fl.StringVar(&f.hostIDFile, "host-id-file", cli.DefaultHostIDFile, "file holding the host ID when --host-id is not given")
	fl.StringVar(&f.secretFile, "secret-file", "", "file holding this host's secret (mode 0600): authenticate with the target, both ways")
	fl.BoolVar(&f.takeover, "takeover", false, "take the export over from the session that holds it read-write, another host's writer of an exclusive export or another live attach of this host: the target fences that session first")
	fl.DurationVar(&f.keepAlive, "keepalive-timeout", initiator.DefaultKeepAlive,
		"a link to the target silent this long is declared dead and the reconnect path runs (probed after a third of it; 0: never)")
	fl.DurationVar(&f.ioTimeout, "io-timeout", initiator.DefaultIOTimeout,
		"a request (grant, RDMA READ or WRITE, trim) unanswered this long takes the link down; it is done again after reconnecting")
	fl.DurationVar(&f.flushTimeout, "flush-timeout", initiator.DefaultFlushTimeout,
		"the same for flushes and FUA writes, which wait for the target's disk")
	fl.StringVar(&f.metrics, "metrics-listen", "", "serve Prometheus /metrics on HOST:PORT")
	fl.StringVar(&f.stateDir, "state-dir", attachstate.DefaultDir, "keep this attach's status file (rblk-attach status) in this folder (empty: none)")
	fl.StringVar(&f.logFormat, "log-format", "console", "log format: console or json")
	fl.BoolVar(&f.debug, "debug", false, "debug logs")
	fl.BoolVar(&f.pprof, "debug-pprof", false, "also serve Go's profiles (CPU, heap, mutex, block, trace) at /debug/pprof/ on --metrics-listen")
	return cmd
}

// listenNBD parses unix:PATH or tcp:HOST:PORT and listens there.
func listenNBD(spec string) (net.Listener, error) {
	network, addr, ok := strings.Cut(spec, ":")
	if !ok || addr == "" || (network != "unix" && network != "tcp") {
		return nil, fmt.Errorf("--nbd-listen %q: want unix:PATH or tcp:HOST:PORT", spec)
	}
	if network == "unix" {
		// A socket file left by an earlier run that nobody listens on.
		if c, err := net.DialTimeout("unix", addr, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("--nbd-listen %s: another process is serving on it", spec)
		}
		if st, err := os.Lstat(addr); err == nil && st.Mode()&os.ModeSocket != 0 {
			os.Remove(addr)
		}
	}
	l, err := net.Listen(network, addr)
	if err != nil {
		return nil, fmt.Errorf("--nbd-listen %s: %w", spec, err)
	}
	return l, nil
}

// maxQueues bounds --queues: each queue is a connection, with its own
// receive buffers and registration of the IO buffers on the target.
const maxQueues = 64

func attach(f attachFlags) error {
	switch {
	case f.target == "":
		return errors.New("--target HOST:PORT is required")
	case f.export == "":
		return errors.New("--export NAME is required")
	}
	if err := f.dev.check(f.nbdListen); err != nil {
		return err
	}
	if err := cli.CheckMetricsOptions(f.metrics, cli.MetricsOptions{Profiling: f.pprof}); err != nil {
		return err
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
	stopMetrics, err := cli.MetricsServer(ctx, f.metrics, reg, log, cli.MetricsOptions{Profiling: f.pprof})
	if err != nil {
		return err
	}
	defer stopMetrics()
	var ln net.Listener
	if f.nbdListen != "" {
		if ln, err = listenNBD(f.nbdListen); err != nil {
			return err
		}
		defer ln.Close()
	}

	hostID, err := cli.HostID(f.hostID, f.hostIDFile, log)
	if err != nil {
		return err
	}
	// This attach's instance: one per process, the same on every
	// reconnect and queue, so that rblkd tells this attach coming back
	// from another attach of the host.
	instance, err := initiator.NewInstance()
	if err != nil {
		return err
	}
	log.Info("attach identity", zap.String("host_id", hostID), zap.String("instance", initiator.FormatInstance(instance)),
		zap.String("export", f.export), zap.String("target", f.target))
	secret, err := readSecret(f.secretFile)
	if err != nil {
		return err
	}
	if f.queues < 0 || f.queues > maxQueues {
		return fmt.Errorf("--queues %d: want 0 (automatic) to %d", f.queues, maxQueues)
	}
	if f.fastFailTimeout < 0 || f.restartGrace < 0 {
		return errors.New("--fast-fail-timeout and --restart-grace: want 0 (none) or more")
	}
	if f.fastFailTimeout > 0 && f.reconnectTimeout > 0 && f.fastFailTimeout >= f.reconnectTimeout {
		return fmt.Errorf("--fast-fail-timeout %v is not shorter than --reconnect-timeout %v: it would never fail fast", f.fastFailTimeout, f.reconnectTimeout)
	}
	if f.takeover && f.readOnly {
		return errors.New("--takeover is for read-write attaches: read-only ones are always shared")
	}
	keepAlive := f.keepAlive
	if keepAlive == 0 {
		keepAlive = -1 // the flag's 0 is "never"; the option's is "default"
	}
	octx, ocancel := context.WithTimeout(ctx, 30*time.Second)
	queues := f.queues
	if queues == 0 {
		queues = 1
		if f.dev.device != "" {
			queues = f.dev.connections
			if queues == 0 {
				queues = kernel.DefaultConnections()
			}
		}
	}
	grow := newGrowHook(log, f.export)
	f.state = newStateFile(ctx, f.stateDir, f, queues, hostID, instance, log)
	defer f.state.remove()
	vol, err := initiator.Open(octx, initiator.Options{OnLink: f.state.onLink, Provider: p, Target: f.target, Export: f.export, HostID: hostID, Instance: instance, Queues: queues,
		Secret: secret, Takeover: f.takeover, ReadOnly: f.readOnly, ReconnectTimeout: reconnectOpt(f.reconnectTimeout), KeepAlive: keepAlive,
		IOTimeout: f.ioTimeout, FlushTimeout: f.flushTimeout, FastFailTimeout: f.fastFailTimeout, RestartGrace: f.restartGrace,
		FailOnLostWrites: f.failOnLostWrites,
		Logger:           log, Metrics: initiator.NewMetrics(reg),
		OnResize: func(oldSize, newSize uint64) { grow.onResize(oldSize, newSize); f.state.resized(newSize) }})
	ocancel()
	if err != nil {
		return fmt.Errorf("attach %q from %s: %w", f.export, f.target, err)
	}
	f.state.opened(p.Name(), vol.Size(), vol.ReadOnly())
	if ublk.IsDevice(f.dev.device) {
		return serveUblk(ctx, f, vol, log, why, grow)
	}
	srv, err := nbd.NewServer(nbd.Options{Exports: []*nbd.Export{nbdExport(vol, f.export)}, Logger: log,
		Metrics: nbd.NewMetrics(reg)})
	if err != nil {
		vol.Close(context.Background())
		return err
	}
	if f.dev.device != "" {
		return serveDevice(ctx, f, vol, srv, log, why, grow)
	}
	log.Info("attached", zap.String("export", f.export), zap.String("target", f.target), zap.String("transport", why),
		zap.String("nbd", f.nbdListen), zap.Uint64("size", vol.Size()), zap.Bool("read_only", vol.ReadOnly()))
	grow.set(vol.Size(), vol.Size(), grow.nbdSocket)
	f.state.attached("")

	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ctx, ln) }()
	var runErr error
	select {
	case <-ctx.Done():
		log.Info("detaching: finishing requests in flight and flushing")
	case <-vol.Done():
		runErr = fmt.Errorf("lost the session with %s: %w", f.target, vol.Err())
		log.Error("target session down", zap.Error(vol.Err()))
	case err := <-serveErr:
		runErr = err
		serveErr <- nil
	}
	f.state.ending(runErr)
	srv.Close()
	<-serveErr
	return closeVolume(vol, log, runErr)
}

// closeVolume flushes and closes vol after the NBD side stopped, and
// returns runErr, or the close's error if runErr is nil.
func closeVolume(vol *initiator.Volume, log *zap.Logger, runErr error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := vol.Close(ctx); err != nil && runErr == nil {
		runErr = fmt.Errorf("detach: %w", err)
	}
	if runErr == nil {
		log.Info("detached cleanly")
	}
	return runErr
}

// reconnectOpt maps the flag (0: never) to initiator.Options (negative: never).
func reconnectOpt(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// readSecret reads --secret-file, if given.
func readSecret(path string) ([]byte, error) {
	if path == "" {
		return nil, nil
	}
	s, err := auth.ReadSecret(path)
	if err != nil {
		return nil, fmt.Errorf("--secret-file: %w", err)
	}
	return s, nil
}

func newListCmd() *cobra.Command {
	var target, transport, hostID, hostIDFile, secretFile string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list --target HOST:PORT",
		Short: "List a target's exports with size and mode",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if target == "" {
				return errors.New("--target HOST:PORT is required")
			}
			p, _, err := providers.Open(transport, nil)
			if err != nil {
				return err
			}
			id, err := cli.HostID(hostID, hostIDFile, zap.NewNop())
			if err != nil {
				return err
			}
			secret, err := readSecret(secretFile)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			exports, err := initiator.List(ctx, p, target, id, secret)
			if err != nil {
				return err
			}
			if asJSON {
				return exportsJSON(cmd.OutOrStdout(), exports)
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tSIZE\tBYTES\tMODE")
			for _, e := range exports {
				mode := "rw"
				if e.Flags&protocol.VolReadOnly != 0 {
					mode = "ro"
				}
				fmt.Fprintf(w, "%s\t%s\t%d\t%s\n", e.Name, humanSize(e.Size), e.Size, mode)
			}
			return w.Flush()
		},
	}
	cmd.Flags().StringVar(&target, "target", "", "rblkd address HOST:PORT (required)")
	cmd.Flags().StringVar(&transport, "transport", "auto", "transport: "+providers.Names)
	cmd.Flags().StringVar(&hostID, "host-id", "", "this host's identity (default: read "+cli.DefaultHostIDFile+", created on first use)")
	cmd.Flags().StringVar(&hostIDFile, "host-id-file", cli.DefaultHostIDFile, "file holding the host ID when --host-id is not given")
	cmd.Flags().StringVar(&secretFile, "secret-file", "", "file holding this host's secret (mode 0600)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON list of {name, size, read_only, can_trim, can_zero, can_flush}")
	return cmd
}

func humanSize(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%dB", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f%ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// nbdExport describes vol as an NBD export named name.
func nbdExport(vol *initiator.Volume, name string) *nbd.Export {
	f, ro := vol.Flags(), vol.ReadOnly()
	return &nbd.Export{
		Name: name, Description: vol.Description(), Size: vol.Size(), CurrentSize: vol.Size, ReadOnly: ro,
		CanTrim: !ro && f&protocol.VolCanTrim != 0, CanZero: !ro && f&protocol.VolCanZero != 0,
		CanFlush: true, CanFUA: !ro, MultiConn: true,
		MinBlock: 1, PrefBlock: 4096, MaxBlock: initiator.MaxRequest, Backend: vol,
	}
}
