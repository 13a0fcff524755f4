package main

import (
	"time"

	"github.com/spf13/cobra"

	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/internal/doctor"
	"github.com/rblk/rblk/transport/rdma"
)

func newDoctorCmd() *cobra.Command {
	var (
		o                 doctor.InitiatorOptions
		transport, device string
		json              bool
	)
	cmd := &cobra.Command{
		Use:   "doctor [--transport tcp|rdma|auto] [--device nbd|ublk|none] [--target HOST:PORT] [--json]",
		Short: "Check what rblk-attach needs on this host, and say how to fix what is missing",
		Long: `Doctor checks what rblk-attach attach needs: with --transport rdma (or auto)
the RDMA devices, their ports' state, RoCE v2 GIDs and MTU, the
/dev/infiniband nodes, rdma-core's libraries and the memlock limit; the nbd
module and a free /dev/nbdN, the ublk driver (Linux >= 6.0), the host ID file
and the secret file and their permissions, the target (with --target: a
connection over the transport), and the clock. It prints each check, and under
each failure what to do. It exits 1 when a needed check failed (the RDMA ones
are needed only with --transport rdma; the nbd module with --device nbd, the
ublk driver with --device ublk), else 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if o.Transport, err = doctor.ParseTransport(transport); err != nil {
				return err
			}
			if o.Device, err = doctor.ParseDevice(device); err != nil {
				return err
			}
			ctx, cancel := cli.SignalContext()
			defer cancel()
			checks := doctor.DefaultEnv(rdma.Supported).Initiator(ctx, o)
			return doctor.Report(cmd.OutOrStdout(), checks, json)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&transport, "transport", "auto", "transport to check for: tcp, rdma (the RDMA checks are needed), auto (they are reported)")
	fl.StringVar(&device, "device", doctor.DeviceNBD, "how volumes are attached: nbd (--device /dev/nbdN|auto), ublk (--device ublk), none (--nbd-listen)")
	fl.StringVar(&o.HostID, "host-id", "", "attach's --host-id")
	fl.StringVar(&o.HostIDFile, "host-id-file", cli.DefaultHostIDFile, "attach's --host-id-file")
	fl.StringVar(&o.SecretFile, "secret-file", "", "attach's --secret-file")
	fl.StringVar(&o.Target, "target", "", "rblkd address HOST:PORT to try a connection to")
	fl.DurationVar(&o.DialTimeout, "timeout", 5*time.Second, "how long the connection to --target may take")
	fl.BoolVar(&json, "json", false, "print a JSON list of checks {name, ok, needed, detail, fix}")
	return cmd
}
