package csidriver

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/rblk/rblk/initiator/kernel"
	"github.com/rblk/rblk/internal/attachstate"
	"github.com/rblk/rblk/internal/safeopen"
)

// Attacher makes a volume of a target a block device of this node.
type Attacher interface {
	// Attach attaches volume id (volCtx: its target's address and
	// transport, its export) and returns its device. A volume attached
	// already is returned as it is.
	Attach(ctx context.Context, id string, volCtx map[string]string) (device string, err error)
	// Detach detaches volume id; one not attached is no error. It must
	// work when the target is gone.
	Detach(ctx context.Context, id string) error
	// Device returns volume id's device while it is attached and works.
	Device(id string) (device string, ok bool)
}

// Condition is what is wrong with a volume's attach, for
// NodeGetVolumeHealth.
type Condition struct {
	// Health is INACCESSIBLE (the volume's IO waits or fails) or
	// DEGRADED (it serves, with a copy fewer or while one resyncs).
	Health csi.VolumeHealthErrorType
	// Reason is one word (Reconnecting, Failed, Degraded, ...); Message
	// says what and since when.
	Reason, Message string
}

// Conditioner is an Attacher that also tells what is wrong with an
// attach that runs: ok is false when nothing is.
type Conditioner interface {
	Condition(id string) (c Condition, ok bool)
}

// Grower is an Attacher whose volumes need more than the target's growth
// to grow: Grow returns the device's size once it holds want bytes.
type Grower interface {
	Grow(ctx context.Context, id string, want int64) (int64, error)
}

// RBLKAttacher attaches volumes with rblk-attach --device, one process
// per volume, started in a session of its own so that it outlives the
// plugin (a restart of the plugin finds it through its record).
type RBLKAttacher struct {
	// Bin is rblk-attach.
	Bin string
	// HostID and SecretFile are the node's identity (rblk-attach
	// --host-id, --secret-file; SecretFile may be empty).
	HostID, SecretFile string
	// StateDir keeps a record per attached volume, and rblk-attach's
	// status files (its --state-dir).
	StateDir string
	// DeviceKind is rblk-attach's --device: auto (/dev/nbdN, the
	// default) or ublk.
	DeviceKind string
	// Timeout bounds an attach. Default 60 s.
	Timeout time.Duration
	// Args are more arguments of rblk-attach attach, such as
	// --reconnect-timeout, --request-timeout or --queues (see
	// CheckAttachArgs).
	Args []string
	// AdoptTimeout is rblk-attach's --dead-conn-timeout on /dev/nbdN:
	// when an rblk-attach dies (the plugin's container restarted with
	// it), how long the kernel holds its volume's IO for the next plugin
	// to adopt the device (Recover). 0: DefaultAdoptTimeout; negative:
	// none (IO fails at once).
	AdoptTimeout time.Duration
}

// DefaultAdoptTimeout is RBLKAttacher.AdoptTimeout's default: long
// enough for a node plugin's container to be restarted.
const DefaultAdoptTimeout = 2 * time.Minute

// attachRecord is what RBLKAttacher keeps of an attached volume.
type attachRecord struct {
	VolumeID string `json:"volume_id"`
	PID      int    `json:"pid"`
	Device   string `json:"device"`
	// Backend is the device's backend identifier
	// (/sys/block/nbdN/backend) and Args rblk-attach's arguments: an
	// adoption checks the one and runs the other with --adopt.
	Backend string   `json:"backend,omitempty"`
	Args    []string `json:"args,omitempty"`
}

// recordFile is the record of volume id in dir: PREFIX-HASH.json (a
// hash: IDs hold '/').
func recordFile(dir, prefix, id string) string {
	sum := sha256.Sum256([]byte(id))
	return filepath.Join(dir, prefix+"-"+hex.EncodeToString(sum[:12])+".json")
}

// readJSON reads the record at path into v (at most 64 KiB, no symlink
// followed); false when there is none, or not one of JSON.
func readJSON(path string, v any) bool {
	b, _, err := safeopen.ReadFile(path, 64<<10)
	return err == nil && json.Unmarshal(b, v) == nil
}

func (a *RBLKAttacher) recordPath(id string) string { return recordFile(a.StateDir, "csi", id) }

func (a *RBLKAttacher) read(id string) (*attachRecord, bool) {
	var r attachRecord
	if !readJSON(a.recordPath(id), &r) || r.VolumeID != id {
		return nil, false
	}
	return &r, true
}

// alive reports whether the record's rblk-attach still runs and its
// device is there.
func (r *attachRecord) alive() bool {
	if r.PID <= 0 || syscall.Kill(r.PID, 0) != nil {
		return false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", r.PID))
	if err != nil || !strings.Contains(string(cmdline), "attach") {
		return false // (the pid is another process's now)
	}
	_, err = os.Stat(r.Device)
	return err == nil
}

// Device implements Attacher.
func (a *RBLKAttacher) Device(id string) (string, bool) {
	r, ok := a.read(id)
	if !ok || !r.alive() {
		return "", false
	}
	return r.Device, true
}

// Condition implements Conditioner from the status file of volume id's
// rblk-attach (its --state-dir is StateDir): "Reconnecting" while the
// target is unreachable (IO waits), "Failed" once the session is lost for
// good (the process is exiting).
func (a *RBLKAttacher) Condition(id string) (Condition, bool) {
	r, ok := a.read(id)
	if !ok || !r.alive() {
		return Condition{}, false
	}
	es, _ := attachstate.List(a.StateDir)
	for _, e := range es {
		if e.PID != r.PID {
			continue
		}
		switch e.State {
		case attachstate.Reconnecting:
			io := "waits for it"
			if slices.ContainsFunc(r.Args, func(a string) bool { return strings.HasPrefix(a, "--fast-fail-timeout") }) {
				io = "fails fast (--fast-fail-timeout) until it is back"
			}
			return Condition{csi.VolumeHealthErrorType_INACCESSIBLE, "Reconnecting", fmt.Sprintf("the target %s is unreachable since %s (%d reconnects so far): IO on %s %s",
				e.Target, e.Since.UTC().Format(time.RFC3339), e.Reconnects, r.Device, io)}, true
		case attachstate.Failed:
			return Condition{csi.VolumeHealthErrorType_INACCESSIBLE, "Failed",
				fmt.Sprintf("the session with the target %s is lost (since %s): IO on %s fails", e.Target, e.Since.UTC().Format(time.RFC3339), r.Device)}, true
		}
	}
	return Condition{}, false
}

// Grow implements Grower: the device grows when its rblk-attach learns
// of the volume's growth, a moment after ControllerExpandVolume.
func (a *RBLKAttacher) Grow(ctx context.Context, id string, want int64) (int64, error) {
	dev, ok := a.Device(id)
	if !ok {
		return 0, fmt.Errorf("volume %s is not attached on this node", id)
	}
	return waitDeviceSize(ctx, dev, want)
}

// attachedRE finds the device in rblk-attach's "attached" log line.
var attachedRE = regexp.MustCompile(`"msg":"attached".*"device":"(/[^"\\]+)"`)

// Attach implements Attacher. A volume whose rblk-attach died while its
// /dev/nbdN stayed attached is adopted, not attached again.
func (a *RBLKAttacher) Attach(ctx context.Context, id string, volCtx map[string]string) (string, error) {
	if dev, ok := a.Device(id); ok {
		return dev, nil
	}
	if r, ok := a.read(id); ok && a.adoptable(r) {
		return a.adopt(ctx, r)
	}
	addr, export := volCtx[CtxAddress], volCtx[CtxExport]
	if addr == "" || export == "" {
		return "", fmt.Errorf("the volume's context lacks %s or %s", CtxAddress, CtxExport)
	}
	if err := os.MkdirAll(a.StateDir, 0o750); err != nil {
		return "", err
	}
	transport := volCtx[CtxTransport]
	if transport == "" {
		transport = "auto"
	}
	device := a.DeviceKind
	if device == "" {
		device = "auto"
	}
	args := []string{"attach", "--target", addr, "--export", export, "--transport", transport, "--device", device,
		"--host-id", a.HostID, "--state-dir", a.StateDir, "--log-format", "json"}
	if a.SecretFile != "" {
		args = append(args, "--secret-file", a.SecretFile)
	}
	if device == "auto" && a.adoptTimeout() > 0 {
		args = append(args, "--dead-conn-timeout", a.adoptTimeout().String())
	}
	args = append(args, a.Args...)
	return a.start(ctx, attachRecord{VolumeID: id, Backend: "rblk:" + export + "@" + addr, Args: args}, args)
}

// ownFlags are the flags of rblk-attach attach that RBLKAttacher sets.
var ownFlags = []string{"--target", "--export", "--transport", "--device", "--host-id", "--host-id-file", "--state-dir",
	"--log-format", "--secret-file", "--dead-conn-timeout", "--adopt", "--nbd-listen"}

// CheckAttachArgs refuses in RBLKAttacher.Args what is not a flag, or is
// one RBLKAttacher sets itself.
func CheckAttachArgs(args []string) error {
	for i, arg := range args {
		if !strings.HasPrefix(arg, "--") {
			if i > 0 && strings.HasPrefix(args[i-1], "--") && !strings.Contains(args[i-1], "=") {
				continue // (a flag's value)
			}
			return fmt.Errorf("rblk-attach argument %q: want --FLAG=VALUE or --FLAG VALUE", arg)
		}
		name, _, _ := strings.Cut(arg, "=")
		if slices.Contains(ownFlags, name) {
			return fmt.Errorf("rblk-attach argument %s: rblk-csi sets it", name)
		}
	}
	return nil
}

func (a *RBLKAttacher) adoptTimeout() time.Duration {
	if a.AdoptTimeout == 0 {
		return DefaultAdoptTimeout
	}
	return a.AdoptTimeout
}

// adoptable reports whether r's rblk-attach is gone while its /dev/nbdN
// is still attached to the same export and target.
func (a *RBLKAttacher) adoptable(r *attachRecord) bool {
	if r.Backend == "" || len(r.Args) == 0 || r.alive() {
		return false
	}
	st, err := kernel.Stat(r.Device)
	return err == nil && st.Attached && st.Backend == r.Backend
}

// adopt starts an rblk-attach that adopts r's device.
func (a *RBLKAttacher) adopt(ctx context.Context, r *attachRecord) (string, error) {
	args := slices.Clone(r.Args)
	if i := slices.Index(args, "--device"); i >= 0 && i+1 < len(args) {
		args[i+1] = r.Device
	} else {
		args = append(args, "--device", r.Device)
	}
	args = append(args, "--adopt")
	dev, err := a.start(ctx, attachRecord{VolumeID: r.VolumeID, Backend: r.Backend, Args: r.Args}, args)
	if err != nil {
		return "", fmt.Errorf("adopt %s: %w", r.Device, err)
	}
	if dev != r.Device {
		return "", fmt.Errorf("adopt %s: rblk-attach attached %s", r.Device, dev)
	}
	return dev, nil
}

// Recover adopts, after a restart of the plugin, every attached volume
// whose rblk-attach is gone (killed with the plugin's container) while its
// device stayed attached: IO the kernel held goes on, and the file system
// on it stays mounted. Attaches that still run are left as they are. It
// returns how many it adopted, and what failed.
func (a *RBLKAttacher) Recover(ctx context.Context) (int, error) {
	names, err := filepath.Glob(filepath.Join(a.StateDir, "csi-*.json"))
	if err != nil {
		return 0, err
	}
	n := 0
	var errs []error
	for _, name := range names {
		var r attachRecord
		if !readJSON(name, &r) || r.VolumeID == "" || a.recordPath(r.VolumeID) != name || !a.adoptable(&r) {
			continue
		}
		if _, err := a.adopt(ctx, &r); err != nil {
			errs = append(errs, fmt.Errorf("volume %s: %w", r.VolumeID, err))
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// start runs rblk-attach with args until it attached, then writes r with
// its process and device.
func (a *RBLKAttacher) start(ctx context.Context, r attachRecord, args []string) (string, error) {
	logPath := strings.TrimSuffix(a.recordPath(r.VolumeID), ".json") + ".log"
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW, 0o640)
	if err != nil {
		return "", err
	}
	defer logFile.Close()
	cmd := exec.Command(a.Bin, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // (not killed with the plugin)
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("start %s: %w", a.Bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	timeout := a.Timeout
	if timeout == 0 {
		timeout = 60 * time.Second
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if dev := attachedDevice(logPath); dev != "" {
			r.PID, r.Device = cmd.Process.Pid, dev
			if err := writeJSON(a.recordPath(r.VolumeID), r); err != nil {
				cmd.Process.Signal(syscall.SIGTERM)
				return "", err
			}
			return dev, nil
		}
		select {
		case err := <-exited:
			return "", fmt.Errorf("rblk-attach exited (%v): %s", err, tail(logPath))
		case <-wctx.Done():
			cmd.Process.Signal(syscall.SIGTERM)
			return "", fmt.Errorf("rblk-attach did not attach %s within %v: %s", r.Backend, timeout, tail(logPath))
		case <-tick.C:
		}
	}
}

func attachedDevice(logPath string) string {
	f, err := os.Open(logPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(io.LimitReader(f, 4<<20))
	for sc.Scan() {
		if m := attachedRE.FindStringSubmatch(sc.Text()); m != nil {
			return m[1]
		}
	}
	return ""
}

// tail is the end of a log, for an error.
func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return strings.TrimSpace(string(b))
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o640); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Detach implements Attacher: SIGTERM to its rblk-attach, which flushes,
// disconnects the device and exits; a process that does not go within
// the context is killed (the target gone: nothing can be flushed).
func (a *RBLKAttacher) Detach(ctx context.Context, id string) error {
	r, ok := a.read(id)
	if !ok {
		return nil
	}
	if !r.alive() && r.Backend != "" {
		// Its rblk-attach died and nobody adopted the device: disconnect
		// it, failing what the kernel held (nothing can flush it).
		if st, err := kernel.Stat(r.Device); err == nil && st.Attached && st.Backend == r.Backend {
			if err := kernel.Detach(ctx, r.Device); err != nil {
				return fmt.Errorf("disconnect %s, whose rblk-attach is gone: %w", r.Device, err)
			}
		}
	}
	if r.alive() {
		syscall.Kill(r.PID, syscall.SIGTERM)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
	wait:
		for syscall.Kill(r.PID, 0) == nil {
			select {
			case <-ctx.Done():
				syscall.Kill(r.PID, syscall.SIGKILL)
				break wait
			case <-t.C:
			}
		}
	}
	if err := os.Remove(a.recordPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	os.Remove(strings.TrimSuffix(a.recordPath(id), ".json") + ".log")
	return nil
}

// Leg is one copy of a mirror, attached by A as volume ID with VolCtx: a
// mirror.Leg (package mirror) for rblk-mirror and the node plugin.
type Leg struct {
	A      *RBLKAttacher
	ID     string
	VolCtx map[string]string
}

// Device is the copy's device while its rblk-attach runs; serving is
// false while it waits for its target (it reconnects, or failed).
func (l *Leg) Device() (dev string, serving bool) {
	dev, ok := l.A.Device(l.ID)
	if !ok {
		return "", false
	}
	_, bad := l.A.Condition(l.ID)
	return dev, !bad
}

// Reattach attaches the copy again after its rblk-attach ended (its
// record, and a device it left attached, are cleaned up first).
func (l *Leg) Reattach(ctx context.Context) (string, error) {
	if err := l.A.Detach(ctx, l.ID); err != nil {
		return "", err
	}
	return l.A.Attach(ctx, l.ID, l.VolCtx)
}
