package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rblk/rblk/admin"
	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
)

func newVolumeCmd() *cobra.Command {
	var socket string
	var timeout time.Duration
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "volume pools|list|create|delete|expand|publish|unpublish",
		Short: "Manage the volumes of a running rblkd's storage pools (through its admin socket, as root)",
		Long: `Manage the volumes of the storage pools (pools: in rblkd's --config) of the
rblkd that listens on --socket: the same operations as its remote management API.

A volume NAME of pool POOL is served as the export POOL:NAME, to the hosts it
is published to and no other. create is idempotent (the same name, size and
sharing again: success); delete drains its sessions, writes its data back and
deletes its file; expand grows it online; unpublish fences the host (its
sessions closed and its keys dead) before it answers.`,
	}
	cmd.PersistentFlags().StringVar(&socket, "socket", admin.DefaultSocket, "rblkd's admin socket (rblkd serve --admin-socket)")
	cmd.PersistentFlags().DurationVar(&timeout, "timeout", 10*time.Minute, "give up waiting for rblkd after this long (a delete waits for the drain)")
	cmd.PersistentFlags().BoolVar(&asJSON, "json", false, "print rblkd's answer as JSON")
	run := func(c *cobra.Command, req admin.Request, print func(io.Writer, admin.Response)) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		resp, err := admin.Do(ctx, socket, req)
		if err != nil {
			if resp.Code != "" {
				return fmt.Errorf("%w [%s]", err, resp.Code)
			}
			return err
		}
		if asJSON {
			enc := json.NewEncoder(c.OutOrStdout())
			enc.SetIndent("", "  ")
			return enc.Encode(resp)
		}
		print(c.OutOrStdout(), resp)
		return nil
	}
	message := func(w io.Writer, resp admin.Response) { fmt.Fprintln(w, resp.Message) }
	size := func(s string) (int64, error) {
		n, err := target.ParseSize(s)
		if err != nil || n <= 0 {
			return 0, fmt.Errorf("size %q: want a size above 0 with an optional K, M, G or T suffix", s)
		}
		return n, nil
	}

	pools := &cobra.Command{
		Use:   "pools [POOL]",
		Short: "List the pools with their capacity",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			req := admin.Request{Command: admin.CmdPools}
			if len(args) == 1 {
				req.Pool = args[0]
			}
			return run(c, req, printPools)
		},
	}
	list := &cobra.Command{
		Use:   "list [POOL]",
		Short: "List the volumes, with their sizes, hosts and sessions",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			req := admin.Request{Command: admin.CmdVolumes}
			if len(args) == 1 {
				req.Pool = args[0]
			}
			return run(c, req, printVolumes)
		},
	}
	var shared bool
	create := &cobra.Command{
		Use:   "create POOL NAME SIZE [--shared]",
		Short: "Create a volume (a sparse file of the pool) and serve it, published to no host",
		Args:  cobra.ExactArgs(3),
		RunE: func(c *cobra.Command, args []string) error {
			n, err := size(args[2])
			if err != nil {
				return err
			}
			return run(c, admin.Request{Command: admin.CmdCreate, Pool: args[0], Name: args[1], Size: n, Shared: shared}, message)
		},
	}
	create.Flags().BoolVar(&shared, "shared", false, "let several hosts write at once (cluster file systems)")
	del := &cobra.Command{
		Use:   "delete POOL NAME",
		Short: "Drain a volume's sessions, write its data back and delete it",
		Args:  cobra.ExactArgs(2),
		RunE: func(c *cobra.Command, args []string) error {
			return run(c, admin.Request{Command: admin.CmdDelete, Pool: args[0], Name: args[1]}, message)
		},
	}
	expand := &cobra.Command{
		Use:   "expand POOL NAME SIZE",
		Short: "Grow a volume online (attached initiators learn the new size)",
		Args:  cobra.ExactArgs(3),
		RunE: func(c *cobra.Command, args []string) error {
			n, err := size(args[2])
			if err != nil {
				return err
			}
			return run(c, admin.Request{Command: admin.CmdExpand, Pool: args[0], Name: args[1], Size: n}, message)
		},
	}
	publish := &cobra.Command{
		Use:   "publish POOL NAME HOST-ID",
		Short: "Let a host open a volume",
		Args:  cobra.ExactArgs(3),
		RunE: func(c *cobra.Command, args []string) error {
			return run(c, admin.Request{Command: admin.CmdPublish, Pool: args[0], Name: args[1], Host: args[2]}, message)
		},
	}
	unpublish := &cobra.Command{
		Use:   "unpublish POOL NAME HOST-ID",
		Short: "Take a host off a volume: its sessions are fenced (closed, their keys dead) before this returns",
		Args:  cobra.ExactArgs(3),
		RunE: func(c *cobra.Command, args []string) error {
			return run(c, admin.Request{Command: admin.CmdUnpublish, Pool: args[0], Name: args[1], Host: args[2]}, message)
		},
	}
	cmd.AddCommand(pools, list, create, del, expand, publish, unpublish)
	return cmd
}

// printPools writes the pools as a table.
func printPools(w io.Writer, resp admin.Response) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tCAPACITY\tPROVISIONED\tALLOCATED\tAVAILABLE\tVOLUMES\tDAMAGED\tLABELS")
	for _, p := range resp.Pools {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\n", p.Name, config.FormatSize(p.Capacity), config.FormatSize(p.Provisioned),
			config.FormatSize(p.Allocated), config.FormatSize(p.Available), p.Volumes, p.Damaged, labelString(p.Labels))
	}
	tw.Flush()
}

// printVolumes writes the volumes as a table.
func printVolumes(w io.Writer, resp admin.Response) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tNAME\tSIZE\tALLOCATED\tSHARED\tSESSIONS\tWRITERS\tHOSTS")
	for _, v := range resp.Volumes {
		hosts := "-"
		if len(v.Hosts) > 0 {
			hosts = strings.Join(v.Hosts, ",")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%d\t%d\t%s\n", v.Pool, v.Name, config.FormatSize(v.Size), config.FormatSize(v.Allocated),
			v.Shared, v.Sessions, v.Writers, hosts)
	}
	tw.Flush()
	if len(resp.Volumes) == 0 {
		fmt.Fprintln(os.Stderr, "(no volumes)")
	}
}

func labelString(l map[string]string) string {
	if len(l) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(l))
	for k := range l {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i, k := range keys {
		keys[i] = k + "=" + l[k]
	}
	return strings.Join(keys, ",")
}
