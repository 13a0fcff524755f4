package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/internal/doctor"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/rdma"
)

type doctorFlags struct {
	transport, listen, authFile, targetID, cacheSize, config string
	exports                                                  []string
	allowUnauthenticated, json                               bool
}

func newDoctorCmd() *cobra.Command {
	var f doctorFlags
	cmd := &cobra.Command{
		Use:   "doctor [--transport tcp|rdma|auto] [serve's --listen, --auth-file, --export, --cache-size ...] [--json]",
		Short: "Check what rblkd needs on this host, and say how to fix what is missing",
		Long: `Doctor checks what rblkd serve needs, given the same flags: with --transport rdma
(or auto) the RDMA devices, their ports' state, RoCE v2 GIDs and MTU, the
/dev/infiniband nodes, rdma-core's libraries and the memlock limit; the listen
address, the auth file and its permissions, the target ID, each export's
backing file and the free space of its file system, the memory for
--cache-size, and the clock. It prints each check, and under each failure what
to do. It exits 1 when a needed check failed (the RDMA ones are needed only
with --transport rdma), else 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runDoctor(cmd, &f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.transport, "transport", "auto", "transport to check for: tcp, rdma (the RDMA checks are needed), auto (they are reported)")
	fl.StringVar(&f.listen, "listen", "", "address rblkd would listen on (default as serve's)")
	fl.StringVar(&f.authFile, "auth-file", "", "serve's --auth-file")
	fl.BoolVar(&f.allowUnauthenticated, "allow-unauthenticated", false, "serve's --allow-unauthenticated")
	fl.StringVar(&f.targetID, "target-id", "", "serve's --target-id (default: the host name)")
	fl.StringArrayVar(&f.exports, "export", nil, "serve's --export NAME=PATH[,ro][,size=BYTES]... (repeatable)")
	fl.StringVar(&f.cacheSize, "cache-size", "256M", "serve's --cache-size")
	fl.StringVar(&f.config, "config", "", "serve's --config: check what that file configures (flags given here override it)")
	fl.BoolVar(&f.json, "json", false, "print a JSON list of checks {name, ok, needed, detail, fix}")
	return cmd
}

func runDoctor(cmd *cobra.Command, f *doctorFlags) error {
	var fileExports []target.ExportConfig
	if f.config != "" {
		// The file's settings that doctor checks, under the flags given.
		c, err := config.Load(f.config)
		if err != nil {
			return fmt.Errorf("--config: %w", err)
		}
		fl := cmd.Flags()
		for _, s := range c.Settings {
			name := config.FlagName(s.Key)
			if fg := fl.Lookup(name); fg != nil && !fl.Changed(name) && name != "json" && name != "config" {
				if err := fg.Value.Set(s.Value); err != nil {
					return fmt.Errorf("--config: %w", &config.Error{File: c.Path, Line: s.Line, Field: s.Key, Msg: err.Error()})
				}
			}
		}
		fileExports = c.ExportConfigs()
	}
	transport, err := doctor.ParseTransport(f.transport)
	if err != nil {
		return err
	}
	o := doctor.TargetOptions{Transport: transport, AuthFile: f.authFile, TargetID: f.targetID}
	flagExports, err := parseExports(f.exports)
	if err != nil {
		return err
	}
	o.Exports = mergeExports(fileExports, flagExports)
	if o.CacheSize, err = target.ParseSize(f.cacheSize); err != nil {
		return fmt.Errorf("--cache-size: %w", err)
	}
	o.Listen, o.ListenErr = listenAddr(f.listen, f.authFile != "", f.allowUnauthenticated)
	ctx, cancel := cli.SignalContext()
	defer cancel()
	checks := doctor.DefaultEnv(rdma.Supported).Target(ctx, o)
	return doctor.Report(cmd.OutOrStdout(), checks, f.json)
}
