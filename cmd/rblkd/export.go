package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rblk/rblk/admin"
	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
)

// exportListJSON is the stable shape of rblkd export list --json.
type exportListJSON struct {
	Exports []admin.Export `json:"exports"`
}

func newExportCmd() *cobra.Command {
	var socket string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "export list|add|remove|grow|reload",
		Short: "Manage the exports of a running rblkd (through its admin socket, as root)",
		Long: `Manage the exports of the rblkd that listens on --socket, without a restart.

add serves a new export at once; remove drains its sessions (their initiators
finish their IO, flush and disconnect), writes its dirty chunks back, syncs
and closes its file; grow enlarges a volume online (never shrinks it).
With --save the change is also written to the --config file rblkd was
started with (comments and order kept), which stays the one source of truth:
a reload (SIGHUP, rblkd export reload) makes the exports those of the file,
so a change made without --save lasts until then.`,
	}
	cmd.PersistentFlags().StringVar(&socket, "socket", admin.DefaultSocket, "rblkd's admin socket (rblkd serve --admin-socket)")
	cmd.PersistentFlags().DurationVar(&timeout, "timeout", 10*time.Minute, "give up waiting for rblkd after this long (a remove waits for the drain)")
	do := func(req admin.Request) (admin.Response, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		return admin.Do(ctx, socket, req)
	}
	done := func(c *cobra.Command, resp admin.Response) {
		fmt.Fprintln(c.OutOrStdout(), resp.Message)
	}

	var asJSON bool
	list := &cobra.Command{
		Use:   "list [--json]",
		Short: "List the exports, with their sizes and sessions",
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			resp, err := do(admin.Request{Command: admin.CmdList})
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(c.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(exportListJSON{Exports: append([]admin.Export{}, resp.Exports...)})
			}
			printExports(c.OutOrStdout(), resp.Exports)
			return nil
		},
	}
	list.Flags().BoolVar(&asJSON, "json", false, `print {"exports": [{"name", "path", "size", "configured_size", "read_only", "shared", "allow", "sessions", "writers", "block_device"}, ...]}`)

	var size string
	var readOnly, shared, save bool
	var allow []string
	add := &cobra.Command{
		Use:   "add NAME PATH [--size BYTES] [--read-only] [--shared] [--allow ID1,ID2] [--save]",
		Short: "Serve a new export at once",
		Args:  cobra.ExactArgs(2),
		RunE: func(c *cobra.Command, args []string) error {
			// rblkd resolves a relative path from its own directory: send
			// this one's.
			path, err := filepath.Abs(args[1])
			if err != nil {
				return fmt.Errorf("path %q: %w", args[1], err)
			}
			x := &admin.Export{Name: args[0], Path: path, ReadOnly: readOnly, Shared: shared, Allow: allow}
			if size != "" {
				n, err := target.ParseSize(size)
				if err != nil || n <= 0 {
					return fmt.Errorf("--size %q: want a size above 0 with an optional K, M, G or T suffix", size)
				}
				x.Size = n
			}
			resp, err := do(admin.Request{Command: admin.CmdAdd, Export: x, Save: save})
			if err != nil {
				return err
			}
			done(c, resp)
			return nil
		},
	}
	add.Flags().StringVar(&size, "size", "", "create PATH as a sparse file of this size if it does not exist (K, M, G, T suffixes)")
	add.Flags().BoolVar(&readOnly, "read-only", false, "refuse writes, trims and write-zeroes")
	add.Flags().BoolVar(&shared, "shared", false, "let several hosts write at once (cluster file systems)")
	add.Flags().StringSliceVar(&allow, "allow", nil, "only these host IDs may list and open it (comma-separated, repeatable)")

	remove := &cobra.Command{
		Use:   "remove NAME [--save]",
		Short: "Drain an export's sessions, write its data back and stop serving it",
		Args:  cobra.ExactArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			resp, err := do(admin.Request{Command: admin.CmdRemove, Name: args[0], Save: save})
			if err != nil {
				return err
			}
			done(c, resp)
			return nil
		},
	}
	grow := &cobra.Command{
		Use:   "grow NAME SIZE [--save]",
		Short: "Enlarge a volume online (attached initiators learn the new size)",
		Args:  cobra.ExactArgs(2),
		RunE: func(c *cobra.Command, args []string) error {
			n, err := target.ParseSize(args[1])
			if err != nil || n <= 0 {
				return fmt.Errorf("size %q: want a size above 0 with an optional K, M, G or T suffix", args[1])
			}
			resp, err := do(admin.Request{Command: admin.CmdGrow, Name: args[0], Size: n, Save: save})
			if err != nil {
				return err
			}
			done(c, resp)
			return nil
		},
	}
	for _, c := range []*cobra.Command{add, remove, grow} {
		c.Flags().BoolVar(&save, "save", false, "also write the change to the --config file rblkd was started with")
	}
	reload := &cobra.Command{
		Use:   "reload",
		Short: "Reload rblkd's --config file, as SIGHUP does, and say what changed",
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			resp, err := do(admin.Request{Command: admin.CmdReload})
			if err != nil {
				return err
			}
			done(c, resp)
			return nil
		},
	}
	cmd.AddCommand(list, add, remove, grow, reload)
	return cmd
}

// printExports writes the exports as a table.
func printExports(w io.Writer, exports []admin.Export) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSIZE\tMODE\tSHARED\tSESSIONS\tWRITERS\tALLOW\tPATH")
	for _, e := range exports {
		mode := "rw"
		if e.ReadOnly {
			mode = "ro"
		}
		allow := "*"
		if len(e.Allow) > 0 {
			allow = strings.Join(e.Allow, ",")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%d\t%d\t%s\t%s\n", e.Name, config.FormatSize(e.Size), mode, e.Shared, e.Sessions, e.Writers, allow, e.Path)
	}
	tw.Flush()
	if len(exports) == 0 {
		fmt.Fprintln(os.Stderr, "(no exports)")
	}
}
