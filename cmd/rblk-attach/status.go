package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/rblk/rblk/cmd/internal/cli"
	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/ublk"
	"github.com/rblk/rblk/internal/attachstate"
	"github.com/rblk/rblk/protocol"
)

// stateFile is this attach's status file (see package attachstate) and its
// systemd notifications. A nil *stateFile (the folder could not be
// written) still notifies systemd.
type stateFile struct {
	rec *attachstate.Record
	log *zap.Logger
	ctx context.Context // the signal context: STOPPING=1 when it ends
}

// newStateFile creates this process's status file in dir, in state
// connecting. A failure is logged, not fatal: the attach works without it
// (rblk-attach status does not show it).
func newStateFile(ctx context.Context, dir string, f attachFlags, queues int, hostID string, instance uint64, log *zap.Logger) *stateFile {
	s := &stateFile{log: log, ctx: ctx}
	if dir == "" {
		return s
	}
	e := attachstate.Entry{Export: f.export, Target: f.target, Transport: f.transport, State: attachstate.Connecting,
		Queues: queues, ReadOnly: f.readOnly, HostID: hostID, Instance: initiator.FormatInstance(instance)}
	if f.nbdListen != "" {
		e.Socket = f.nbdListen
	}
	rec, err := attachstate.Create(dir, e)
	if err != nil {
		log.Warn("no status file: rblk-attach status will not show this attach (give --state-dir)", zap.String("dir", dir), zap.Error(err))
		return s
	}
	s.rec = rec
	return s
}

func (s *stateFile) update(f func(*attachstate.Entry)) {
	if s.rec == nil {
		return
	}
	if err := s.rec.Update(f); err != nil {
		s.log.Warn("update the status file", zap.Error(err))
	}
}

// opened records what the volume turned out to be.
func (s *stateFile) opened(transport string, size uint64, readOnly bool) {
	s.update(func(e *attachstate.Entry) { e.Transport, e.Size, e.ReadOnly = transport, size, readOnly })
}

// resized records the volume's size after it grew online.
func (s *stateFile) resized(size uint64) {
	s.update(func(e *attachstate.Entry) { e.Size = size })
}

// attached records the device (empty for an NBD socket) and state up, and
// tells systemd the attach is ready.
func (s *stateFile) attached(device string) {
	s.update(func(e *attachstate.Entry) {
		if device != "" {
			e.Device = device
		}
		e.State = attachstate.Up
	})
	what := device
	if what == "" && s.rec != nil {
		what = s.rec.Entry().Socket
	}
	cli.NotifyReady(s.ctx, s.log, "attached as "+what)
}

// onLink is initiator.Options.OnLink.
func (s *stateFile) onLink(up bool, reconnects int) {
	s.update(func(e *attachstate.Entry) {
		e.State = attachstate.Reconnecting
		if up {
			e.State = attachstate.Up
		}
		e.Reconnects = reconnects
	})
}

// setState records a state: draining or failed.
func (s *stateFile) setState(st attachstate.State) {
	s.update(func(e *attachstate.Entry) { e.State = st })
}

// remove deletes the status file at exit.
func (s *stateFile) remove() {
	if s.rec == nil {
		return
	}
	if err := s.rec.Remove(); err != nil {
		s.log.Warn("remove the status file", zap.Error(err))
	}
}

// ending records how serving ends: draining (a signal, a detach), or
// failed with runErr.
func (s *stateFile) ending(runErr error) {
	if runErr == nil {
		s.setState(attachstate.Draining)
	} else {
		s.setState(attachstate.Failed)
	}
}

func newStatusCmd() *cobra.Command {
	var dir string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status [--json]",
		Short: "List the attaches running on this host: device or socket, export, target, state, reconnects, host ID and instance",
		Long: `Status lists every rblk-attach attach running on this host, from the status
files they keep in --state-dir: the device (/dev/nbdN, /dev/ublkbN) or NBD socket,
the export and target, the transport, the state (connecting, up, reconnecting,
draining, failed), the reconnects so far, since when it is in its state, and
the host ID and instance it attaches as (rblkd names the instance when it
refuses another attach of the export).
With --json it prints a JSON list of those objects (see README, Status).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			es, err := attachstate.List(dir)
			if err != nil {
				return fmt.Errorf("--state-dir %s: %w", dir, err)
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), es)
			}
			return printStatus(cmd.OutOrStdout(), es)
		},
	}
	cmd.Flags().StringVar(&dir, "state-dir", attachstate.DefaultDir, "folder of the attaches' status files")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON list")
	return cmd
}

// writeJSON prints v indented; a nil slice prints as [].
func writeJSON[T any](w io.Writer, v []T) error {
	if v == nil {
		v = []T{}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func printStatus(out io.Writer, es []attachstate.Entry) error {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "PID\tDEVICE\tEXPORT\tTARGET\tTRANSPORT\tSTATE\tSINCE\tRECONNECTS\tQUEUES\tHOST ID\tINSTANCE")
	for _, e := range es {
		dev := e.Device
		if dev == "" {
			dev = e.Socket
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\t%s\n", e.PID, dev, e.Export, e.Target, e.Transport, e.State,
			e.Since.Local().Format(time.DateTime), e.Reconnects, e.Queues, orDash(e.HostID), orDash(e.Instance))
	}
	return w.Flush()
}

// orDash is s, or "-" for an empty field of the table.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// exportJSON is an element of rblk-attach list --json.
type exportJSON struct {
	Name     string `json:"name"`
	Size     uint64 `json:"size"`
	ReadOnly bool   `json:"read_only"`
	CanTrim  bool   `json:"can_trim"`
	CanZero  bool   `json:"can_zero"`
	CanFlush bool   `json:"can_flush"`
}

func exportsJSON(w io.Writer, exports []protocol.ExportEntry) error {
	out := make([]exportJSON, 0, len(exports))
	for _, e := range exports {
		out = append(out, exportJSON{Name: e.Name, Size: e.Size, ReadOnly: e.Flags&protocol.VolReadOnly != 0,
			CanTrim: e.Flags&protocol.VolCanTrim != 0, CanZero: e.Flags&protocol.VolCanZero != 0, CanFlush: e.Flags&protocol.VolCanFlush != 0})
	}
	return writeJSON(w, out)
}

func newUdevIDCmd() *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:    "udev-id nbdN|ublkbN",
		Short:  "Print RBLK_TARGET= and RBLK_EXPORT= of a device attached by rblk-attach, for udev's IMPORT{program}",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			target, export, err := udevID(args[0], dir)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "RBLK_TARGET=%s\nRBLK_EXPORT=%s\n", udevName(target), udevName(export))
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "state-dir", attachstate.DefaultDir, "folder of the attaches' status files")
	return cmd
}

// errNotRblk is returned by udevID for a device rblk-attach does not serve.
var errNotRblk = errors.New("not attached by rblk-attach")

var (
	nbdName  = regexp.MustCompile(`^nbd[0-9]+$`)
	ublkName = regexp.MustCompile(`^ublkb[0-9]+$`)
)

// udevID finds the target and export of kernel device name (nbdN: from
// the backend identifier rblk-attach gave the kernel, "rblk:EXPORT@TARGET";
// ublkbN: from the status file of the process serving it).
func udevID(name, dir string) (target, export string, err error) {
	name = filepath.Base(name)
	switch {
	case nbdName.MatchString(name):
		b, err := os.ReadFile(filepath.Join("/sys/block", name, "backend"))
		if err != nil {
			return "", "", fmt.Errorf("%s: %w: %w", name, errNotRblk, err)
		}
		target, export, ok := parseBackend(string(b))
		if !ok {
			return "", "", fmt.Errorf("%s: backend %q: %w", name, b, errNotRblk)
		}
		return target, export, nil
	case ublkName.MatchString(name):
		pid, _, err := ublk.ServerPID("/dev/" + name)
		if err != nil {
			return "", "", fmt.Errorf("%s: %w", name, err)
		}
		es, err := attachstate.List(dir)
		if err != nil {
			return "", "", fmt.Errorf("%s: %w", name, err)
		}
		for _, e := range es {
			if e.PID == pid {
				return e.Target, e.Export, nil
			}
		}
		return "", "", fmt.Errorf("%s: served by process %d, which has no status file in %s: %w", name, pid, dir, errNotRblk)
	}
	return "", "", fmt.Errorf("%q: want nbdN or ublkbN", name)
}

// parseBackend splits the backend identifier rblk-attach gives an NBD
// device, "rblk:EXPORT@TARGET" (see serveDevice); an export's name may hold
// '@', a target's address does not.
func parseBackend(s string) (target, export string, ok bool) {
	id, ok := strings.CutPrefix(strings.TrimSpace(s), "rblk:")
	i := strings.LastIndexByte(id, '@')
	if !ok || i <= 0 || i == len(id)-1 {
		return "", "", false
	}
	return id[i+1:], id[:i], true
}

// udevName makes s one safe path component of a udev symlink: the
// characters udev keeps in SYMLINK (letters, digits, "#+-.:=@_"), every
// other byte ('/', '[', ']', spaces...) as '_'; "." and ".." are escaped.
func udevName(s string) string {
	b := []byte(s)
	for i, c := range b {
		ok := c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || strings.IndexByte("#+-.:=@_", c) >= 0
		if !ok {
			b[i] = '_'
		}
	}
	switch s := string(b); s {
	case "", ".", "..":
		return strings.Repeat("_", max(len(s), 1))
	default:
		return s
	}
}
