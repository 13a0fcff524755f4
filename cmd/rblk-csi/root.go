package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/csidriver"
	"github.com/rblk/rblk/manage/remote"
	"github.com/rblk/rblk/mirror"
)

// version is set at build time (-ldflags -X main.version=...).
var version = "dev"

type flags struct {
	mode, endpoint, logFormat         string
	debug                             bool
	inventory, tlsCert, tlsKey, tlsCA string
	hostID, hostIDFile                string
	topology                          []string
	attachBin, secretFile, stateDir   string
	device, defaultFS                 string
	adoptTimeout                      time.Duration
	attachArgs, mirrorArgs            []string
	metricsListen                     string
}

func newRootCmd() *cobra.Command {
	var f flags
	root := &cobra.Command{
		Use:   "rblk-csi --mode controller|node --endpoint unix:///PATH",
		Short: "rblk's CSI driver: volumes in rblkd's storage pools for Kubernetes",
		Long: `rblk-csi serves the CSI identity service and, by --mode, the controller
service (one per cluster, beside external-provisioner, external-attacher and
external-resizer: it creates, publishes, fences and grows volumes in the pools
of the rblkd targets of --inventory through their management API) or the node
service (one per node, beside node-driver-registrar: its node ID is the node's
rblk host ID).`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE:          func(*cobra.Command, []string) error { return run(f) },
	}
	fl := root.Flags()
	fl.StringVar(&f.mode, "mode", "", "controller or node (required)")
	fl.StringVar(&f.endpoint, "endpoint", "unix:///csi/csi.sock", "the CSI socket, unix:///PATH")
	fl.StringVar(&f.logFormat, "log-format", "json", "log format: console or json")
	fl.BoolVar(&f.debug, "debug", false, "debug logs")
	fl.StringVar(&f.inventory, "inventory", "", "controller: the targets, a YAML file (see README, Kubernetes)")
	fl.StringVar(&f.tlsCert, "tls-cert", "", "controller: the client certificate for the targets' management API")
	fl.StringVar(&f.tlsKey, "tls-key", "", "controller: its key")
	fl.StringVar(&f.tlsCA, "tls-ca", "", "controller: the CA that signs the targets' certificates")
	fl.StringVar(&f.hostID, "host-id", "", "node: this node's rblk host ID, its CSI node ID (default: --host-id-file)")
	fl.StringVar(&f.hostIDFile, "host-id-file", "/etc/rblk/hostid", "node: the file of this node's host ID")
	fl.StringArrayVar(&f.topology, "topology", nil, "node: KEY=VALUE, where the node is (repeatable): the labels of the pools it reaches")
	fl.StringVar(&f.attachBin, "attach-bin", "rblk-attach", "node: the rblk-attach that attaches volumes")
	fl.StringVar(&f.secretFile, "secret-file", "", "node: this node's secret (rblk-attach --secret-file)")
	fl.StringVar(&f.stateDir, "state-dir", "/run/rblk/csi", "node: the attaches' records and status files")
	fl.StringVar(&f.device, "device", "auto", "node: auto (the kernel's /dev/nbdN) or ublk")
	fl.StringArrayVar(&f.attachArgs, "attach-arg", nil, "node: one more argument of rblk-attach attach, such as --reconnect-timeout=30s (repeatable)")
	fl.DurationVar(&f.adoptTimeout, "adopt-timeout", csidriver.DefaultAdoptTimeout, "node: when an rblk-attach dies (its container restarted), how long the kernel holds its /dev/nbdN's IO for the next start of the plugin to adopt the device (0: IO fails at once)")
	fl.StringArrayVar(&f.mirrorArgs, "mirror-attach-arg", nil, "node: the rblk-attach flags of each copy of a volume of replicas: 2, in place of the defaults "+strings.Join(csidriver.DefaultMirrorArgs, " ")+" (repeatable)")
	fl.StringVar(&f.metricsListen, "metrics-listen", "", "node: serve Prometheus metrics (rblk_mirror_* of the staged mirrors) on this HOST:PORT at /metrics (default: none)")
	fl.StringVar(&f.defaultFS, "default-fs", "ext4", "node: the file system made where a volume's capability names none: ext4 or xfs")
	root.AddCommand(cli.GenDocsCmd(root))
	return root
}

func run(f flags) error {
	log, err := cli.NewLogger(f.logFormat, f.debug)
	if err != nil {
		return err
	}
	defer log.Sync()
	ctx, cancel := cli.SignalContext()
	defer cancel()
	id := &csidriver.Identity{Version: version}
	var srv *csidriver.Server
	switch f.mode {
	case "controller":
		if f.inventory == "" || f.tlsCert == "" || f.tlsKey == "" || f.tlsCA == "" {
			return fmt.Errorf("--mode controller needs --inventory, --tls-cert, --tls-key and --tls-ca")
		}
		inv, err := csidriver.LoadInventory(f.inventory)
		if err != nil {
			return err
		}
		tc, err := remote.ClientTLS(f.tlsCert, f.tlsKey, f.tlsCA, "")
		if err != nil {
			return err
		}
		targets, err := csidriver.NewInventory(inv, tc)
		if err != nil {
			return err
		}
		defer targets.Close()
		if srv, err = csidriver.Listen(f.endpoint, id, csidriver.NewController(targets, log), nil, log); err != nil {
			return err
		}
		log.Info("rblk-csi controller serving", zap.String("endpoint", f.endpoint), zap.Int("targets", len(inv.Targets)), zap.String("version", version))
	case "node":
		host, err := cli.HostID(f.hostID, f.hostIDFile, log)
		if err != nil {
			return err
		}
		topo := map[string]string{}
		for _, t := range f.topology {
			k, v, ok := strings.Cut(t, "=")
			if !ok || k == "" {
				return fmt.Errorf("--topology %q: want KEY=VALUE", t)
			}
			topo[k] = v
		}
		if f.device != "auto" && f.device != "ublk" {
			return fmt.Errorf("--device %q: want auto or ublk", f.device)
		}
		if f.defaultFS != "ext4" && f.defaultFS != "xfs" {
			return fmt.Errorf("--default-fs %q: want ext4 or xfs", f.defaultFS)
		}
		if err := csidriver.CheckAttachArgs(f.attachArgs); err != nil {
			return fmt.Errorf("--attach-arg: %w", err)
		}
		if err := csidriver.CheckAttachArgs(f.mirrorArgs); err != nil {
			return fmt.Errorf("--mirror-attach-arg: %w", err)
		}
		if f.adoptTimeout < 0 {
			return fmt.Errorf("--adopt-timeout %v: want 0 (none) or more", f.adoptTimeout)
		}
		adopt := f.adoptTimeout
		if adopt == 0 {
			adopt = -1 // (RBLKAttacher's none)
		}
		att := &csidriver.RBLKAttacher{Bin: f.attachBin, HostID: host, SecretFile: f.secretFile, StateDir: f.stateDir, DeviceKind: f.device,
			AdoptTimeout: adopt, Args: f.attachArgs}
		reg := cli.NewRegistry()
		metrics := mirror.NewMetrics()
		reg.MustRegister(metrics)
		mirrors := &csidriver.MirrorAttacher{A: att, MirrorArgs: f.mirrorArgs, Logger: log, Metrics: metrics}
		defer mirrors.Close()
		stopMetrics, err := cli.MetricsServer(ctx, f.metricsListen, reg, log, cli.MetricsOptions{})
		if err != nil {
			return err
		}
		defer stopMetrics()
		// Before serving: a NodeStage or a stats call finds the attaches
		// as they were before the restart, and the mirrors supervised.
		n, err := att.Recover(ctx)
		if n > 0 || err != nil {
			log.Info("adopted the devices whose rblk-attach had gone", zap.Int("adopted", n), zap.NamedError("failed", err))
		}
		if n, err := mirrors.Resume(); n > 0 || err != nil {
			log.Info("supervising the staged mirrors again", zap.Int("mirrors", n), zap.NamedError("failed", err))
		}
		node := &csidriver.Node{HostID: host, Topology: topo, Attacher: mirrors, DefaultFS: f.defaultFS, Logger: log}
		if srv, err = csidriver.Listen(f.endpoint, id, nil, node, log); err != nil {
			return err
		}
		log.Info("rblk-csi node serving", zap.String("endpoint", f.endpoint), zap.String("node_id", host), zap.Any("topology", topo), zap.String("version", version))
	default:
		return fmt.Errorf("--mode %q: want controller or node", f.mode)
	}
	<-ctx.Done()
	log.Info("stopping")
	srv.Close()
	return nil
}
