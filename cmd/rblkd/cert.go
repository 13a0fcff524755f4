package main

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/rblk/rblk/manage/remote"
)

func newCertCmd() *cobra.Command {
	var dir string
	var days int
	cmd := &cobra.Command{
		Use:   "cert ca|server|client",
		Short: "Make the certificates of the management API for a small installation",
		Long: `Make a CA and the certificates it signs for the management API (management:
in rblkd's --config): rblkd's own (server) and its clients' (client, named by
the identity management: clients: lets in). Keys are ECDSA P-256, written
mode 0600 into --dir; an existing file is never overwritten.

  rblkd cert ca --dir /etc/rblk/tls
  rblkd cert server --dir /etc/rblk/tls --name storage-1 --host storage-1.example --host 192.0.2.10
  rblkd cert client --dir /etc/rblk/tls --name rblk-csi-controller

rblkd uses ca.crt (client_ca:), storage-1.crt and storage-1.key (cert:,
key:); a client its NAME.crt, NAME.key and ca.crt. Keep ca.key off the
storage nodes once the certificates are made.`,
	}
	cmd.PersistentFlags().StringVar(&dir, "dir", "", "folder of ca.crt and ca.key, and of the certificates made (required)")
	cmd.PersistentFlags().IntVar(&days, "days", 825, "validity in days")
	need := func() error {
		if dir == "" {
			return fmt.Errorf("--dir is required")
		}
		if days <= 0 {
			return fmt.Errorf("--days %d: want a number of days above 0", days)
		}
		return nil
	}
	validity := func() time.Duration { return time.Duration(days) * 24 * time.Hour }
	var name string
	var hosts []string
	ca := &cobra.Command{
		Use:   "ca --dir DIR [--name NAME]",
		Short: "Make a CA: DIR/ca.crt and DIR/ca.key",
		Args:  cobra.NoArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := need(); err != nil {
				return err
			}
			if name == "" {
				name = "rblk management CA"
			}
			a, err := remote.NewCA(name, validity())
			if err != nil {
				return err
			}
			cert, key, err := a.PEM()
			if err != nil {
				return err
			}
			if err := remote.WriteNew(filepath.Join(dir, "ca.key"), key, 0o600); err != nil {
				return err
			}
			if err := remote.WriteNew(filepath.Join(dir, "ca.crt"), cert, 0o644); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "made %s and %s\n", filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"))
			return nil
		},
	}
	ca.Flags().StringVar(&name, "name", "", "the CA's name (default \"rblk management CA\")")
	issue := func(client bool) func(*cobra.Command, []string) error {
		return func(c *cobra.Command, _ []string) error {
			if err := need(); err != nil {
				return err
			}
			if name == "" {
				return fmt.Errorf("--name is required")
			}
			if filepath.Base(name) != name || name == "." || name == ".." || name == "ca" {
				return fmt.Errorf("--name %q: want a name that is a file name of its own (not ca)", name)
			}
			if !client && len(hosts) == 0 {
				hosts = []string{name}
			}
			a, err := remote.LoadCA(filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"))
			if err != nil {
				return fmt.Errorf("the CA (rblkd cert ca): %w", err)
			}
			cert, key, err := a.Issue(name, hosts, client, validity())
			if err != nil {
				return err
			}
			if err := remote.WriteNew(filepath.Join(dir, name+".key"), key, 0o600); err != nil {
				return err
			}
			if err := remote.WriteNew(filepath.Join(dir, name+".crt"), cert, 0o644); err != nil {
				return err
			}
			fmt.Fprintf(c.OutOrStdout(), "made %s and %s\n", filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key"))
			return nil
		}
	}
	server := &cobra.Command{
		Use:   "server --dir DIR --name NAME [--host NAME|IP ...]",
		Short: "Make rblkd's certificate, for the names and addresses clients reach it by",
		Args:  cobra.NoArgs,
		RunE:  issue(false),
	}
	server.Flags().StringVar(&name, "name", "", "the server's name (its files: NAME.crt, NAME.key)")
	server.Flags().StringArrayVar(&hosts, "host", nil, "a DNS name or IP address clients dial (repeatable; default --name)")
	client := &cobra.Command{
		Use:   "client --dir DIR --name IDENTITY",
		Short: "Make a client's certificate: IDENTITY is what management: clients: names",
		Args:  cobra.NoArgs,
		RunE:  issue(true),
	}
	client.Flags().StringVar(&name, "name", "", "the client's identity (its files: IDENTITY.crt, IDENTITY.key)")
	cmd.AddCommand(ca, server, client)
	return cmd
}
