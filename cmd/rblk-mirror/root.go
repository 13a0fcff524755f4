package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/csidriver"
	"github.com/rblk/rblk/mirror"
)

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "rblk-mirror",
		Short:         "Keep a volume in two copies on two rblk targets: md RAID1 over two rblk devices",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newUpCmd(), newStatusCmd(), newGrowCmd(), cli.GenDocsCmd(root))
	return root
}

type upFlags struct {
	name, transport, hostID, hostIDFile, secretFile string
	stateDir, attachBin, logFormat, metricsListen   string
	legs                                            []string
	fastFail, reconnect, keepAlive, grace, every    time.Duration
	fresh, debug                                    bool
}

func newUpCmd() *cobra.Command {
	var f upFlags
	cmd := &cobra.Command{
		Use:   "up --name NAME --leg EXPORT@HOST:PORT --leg EXPORT@HOST:PORT",
		Short: "Attach both copies, assemble /dev/md/NAME and keep it whole until SIGINT or SIGTERM",
		Long: `Up attaches each copy (--leg) as /dev/nbdN with rblk-attach, assembles the
md RAID1 /dev/md/NAME over them (created, with an internal write-intent bitmap,
over copies that hold no array yet; --fresh: they are new volumes of zeroes,
created in sync) and keeps it whole while it runs:

  - each copy's rblk-attach fails IO after --fast-fail-timeout without its
    target (md fails that member, the application goes on with the other)
    and goes on reconnecting for --reconnect-timeout;
  - a member md failed is re-added once its target is back: md copies only
    what changed meanwhile (the bitmap);
  - a copy whose target came back without writes it had acknowledged
    (rblk-attach --fail-on-lost-writes ends) is attached again and copied in
    full, never rejoined as if whole.

On SIGINT or SIGTERM it stops the array (unmount it first) and detaches
both copies. rblk-mirror status shows the array.`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error { return up(f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.name, "name", "", "the array's name: /dev/md/NAME (required)")
	fl.StringArrayVar(&f.legs, "leg", nil, "a copy, EXPORT@HOST:PORT (twice)")
	fl.StringVar(&f.transport, "transport", "auto", "tcp, rdma or auto")
	fl.StringVar(&f.hostID, "host-id", "", "this host's ID (default: --host-id-file)")
	fl.StringVar(&f.hostIDFile, "host-id-file", cli.DefaultHostIDFile, "the file of this host's ID")
	fl.StringVar(&f.secretFile, "secret-file", "", "this host's secret (rblk-attach --secret-file)")
	fl.StringVar(&f.stateDir, "state-dir", "/run/rblk/mirror", "the attaches' records, logs and status files")
	fl.StringVar(&f.attachBin, "attach-bin", "rblk-attach", "the rblk-attach that attaches the copies")
	fl.DurationVar(&f.fastFail, "fast-fail-timeout", 5*time.Second, "how long a copy's IO waits for its target before it fails (md then fails the member)")
	fl.DurationVar(&f.reconnect, "reconnect-timeout", 24*time.Hour, "how long a copy's rblk-attach goes on reconnecting to its target")
	fl.DurationVar(&f.keepAlive, "keepalive-timeout", 5*time.Second, "a copy's link to its target silent this long is lost (a target that hangs): its fast-fail time starts then")
	fl.DurationVar(&f.grace, "restart-grace", 30*time.Second, "after a planned restart of a copy's target (rblkd stopped with SIGTERM), how long its IO waits for it before it fails fast: a planned restart degrades nothing")
	fl.DurationVar(&f.every, "check-interval", time.Second, "how often the members are looked at")
	fl.BoolVar(&f.fresh, "fresh", false, "the copies are new volumes of zeroes: create the array in sync instead of copying the first onto the second")
	fl.StringVar(&f.metricsListen, "metrics-listen", "", "serve Prometheus metrics (rblk_mirror_*: degraded, resync progress, members put back) on this HOST:PORT at /metrics (default: none)")
	fl.StringVar(&f.logFormat, "log-format", "console", "console or json")
	fl.BoolVar(&f.debug, "debug", false, "debug logs")
	return cmd
}

// parseLeg splits EXPORT@HOST:PORT.
func parseLeg(s string) (export, target string, err error) {
	i := strings.LastIndexByte(s, '@')
	if i <= 0 || i == len(s)-1 {
		return "", "", fmt.Errorf("--leg %q: want EXPORT@HOST:PORT", s)
	}
	return s[:i], s[i+1:], nil
}

func up(f upFlags) error {
	log, err := cli.NewLogger(f.logFormat, f.debug)
	if err != nil {
		return err
	}
	defer log.Sync()
	if err := mirror.CheckName(f.name); err != nil {
		return fmt.Errorf("--name: %w", err)
	}
	if len(f.legs) != 2 {
		return fmt.Errorf("--leg: want 2 copies, got %d", len(f.legs))
	}
	if f.fastFail <= 0 || f.fastFail >= f.reconnect {
		return fmt.Errorf("--fast-fail-timeout %v: want more than 0 and less than --reconnect-timeout %v", f.fastFail, f.reconnect)
	}
	var parsed [][2]string // export, target: all checked before anything is attached
	for _, s := range f.legs {
		export, target, err := parseLeg(s)
		if err != nil {
			return err
		}
		parsed = append(parsed, [2]string{export, target})
	}
	host, err := cli.HostID(f.hostID, f.hostIDFile, log)
	if err != nil {
		return err
	}
	att := &csidriver.RBLKAttacher{Bin: f.attachBin, HostID: host, SecretFile: f.secretFile, StateDir: f.stateDir,
		AdoptTimeout: -1, // (a dead rblk-attach fails the member at once: md goes on with the other)
		Args: []string{"--fast-fail-timeout=" + f.fastFail.String(), "--reconnect-timeout=" + f.reconnect.String(),
			"--keepalive-timeout=" + f.keepAlive.String(), "--restart-grace=" + f.grace.String(), "--fail-on-lost-writes"}}
	ctx, cancel := cli.SignalContext()
	defer cancel()
	metrics := mirror.NewMetrics()
	reg := cli.NewRegistry()
	reg.MustRegister(metrics)
	stopMetrics, err := cli.MetricsServer(ctx, f.metricsListen, reg, log, cli.MetricsOptions{}) // (before anything is attached: a port in use fails it)
	if err != nil {
		return err
	}
	defer stopMetrics()
	var legs []mirror.Leg
	var members []string
	for i, s := range f.legs {
		export, target := parsed[i][0], parsed[i][1]
		l := &csidriver.Leg{A: att, ID: fmt.Sprintf("mirror/%s/%d", f.name, i),
			VolCtx: map[string]string{csidriver.CtxAddress: target, csidriver.CtxExport: export, csidriver.CtxTransport: f.transport}}
		dev, err := att.Attach(ctx, l.ID, l.VolCtx)
		if err != nil {
			detachAll(att, legs, log)
			return fmt.Errorf("attach %s: %w", s, err)
		}
		log.Info("copy attached", zap.String("leg", s), zap.String("device", dev))
		legs, members = append(legs, l), append(members, dev)
	}
	o := mirror.Options{Name: f.name, Members: members, Fresh: f.fresh, Logger: log, Added: metrics.Added}
	dev, err := mirror.Up(ctx, o)
	if err != nil {
		detachAll(att, legs, log)
		return err
	}
	metrics.Track(o)
	log.Info("mirror up", zap.String("array", o.Path()), zap.String("device", dev), zap.Strings("members", members))
	mirror.Supervise(ctx, o, legs, f.every)

	log.Info("stopping the mirror", zap.String("array", o.Path()))
	sctx, scancel := context.WithTimeout(context.Background(), time.Minute)
	defer scancel()
	if err := mirror.Down(sctx, o); err != nil {
		return fmt.Errorf("%w (its copies stay attached)", err)
	}
	return detachAll(att, legs, log)
}

func detachAll(att *csidriver.RBLKAttacher, legs []mirror.Leg, log *zap.Logger) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var errs []error
	for _, l := range legs {
		if err := att.Detach(ctx, l.(*csidriver.Leg).ID); err != nil {
			errs = append(errs, err)
		}
	}
	err := errors.Join(errs...)
	log.Info("copies detached", zap.NamedError("error", err))
	return err
}

func newStatusCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status NAME",
		Short: "Show /dev/md/NAME: members and their states, degraded, the resync and its progress, mismatches",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			st, err := mirror.Stat(mirror.Options{Name: args[0]})
			if err != nil {
				return err
			}
			if asJSON {
				e := json.NewEncoder(cmd.OutOrStdout())
				e.SetIndent("", "  ")
				return e.Encode(st)
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "%s (/dev/md/%s): degraded %d, sync %s (%s), mismatches %d\n", st.Device, args[0], st.Degraded, st.SyncAction, st.SyncCompleted, st.Mismatches)
			for _, m := range st.Members {
				fmt.Fprintf(out, "  %s\t%s\n", m.Device, m.State)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newGrowCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "grow NAME",
		Short: "Grow /dev/md/NAME to what its copies hold now (after both volumes grew), keeping its bitmap",
		Long: `Grow makes the array as large as its two copies allow (mdadm --grow
--size=max): grow both volumes first (rblkd's pools, or their backing
files); each copy's rblk-attach resizes its device when its target says so.
Then grow the file system on it (resize2fs /dev/md/NAME, xfs_growfs MOUNT).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := mirror.CheckName(args[0]); err != nil {
				return err
			}
			ctx, cancel := cli.SignalContext()
			defer cancel()
			n, err := mirror.Grow(ctx, mirror.Options{Name: args[0]})
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "/dev/md/%s: %d bytes\n", args[0], n)
			return nil
		},
	}
}
