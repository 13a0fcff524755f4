package mirror

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"go.uber.org/zap"
)

// Errors of this package, to test with errors.Is.
var (
	// ErrForeign: a member holds another array's (or another file
	// system's) data; it is never written over.
	ErrForeign = errors.New("holds another array")
	// ErrNotUp: the array is not assembled.
	ErrNotUp = errors.New("the array is not assembled")
)

// DataOffset is where the array's data starts on each member: md's
// superblock and write-intent bitmap live before it. An array is this
// much smaller than its members, whatever their size (mdadm's own choice
// grows with them, up to 128 MiB).
const DataOffset = 4 << 20

// Options name an array and its members.
type Options struct {
	// Name is the array's name: /dev/md/NAME (CheckName).
	Name string
	// Members are the member devices (/dev/nbdN), two for RAID1.
	Members []string
	// Fresh: the members are new volumes that read as zeroes: Up creates
	// the array in sync (--assume-clean) instead of copying one member
	// onto the other.
	Fresh bool
	// Run runs a command and returns its standard output; on failure
	// the error carries its standard error. Default: exec.
	Run func(ctx context.Context, name string, args ...string) ([]byte, error)
	// Logger: one line per change of the array. Default: none.
	Logger *zap.Logger
	// Added, if set, is told of each member Add put back (full: copied
	// in full, else from the bitmap): Metrics.Added.
	Added func(array string, full bool)

	// SysBlock and DevDir are where the kernel shows devices: /sys/block
	// and /dev by default (tests set them: package mirrortest).
	SysBlock, DevDir string
}

func (o *Options) defaults() {
	if o.Run == nil {
		o.Run = run
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.SysBlock == "" {
		o.SysBlock = "/sys/block"
	}
	if o.DevDir == "" {
		o.DevDir = "/dev"
	}
}

func (o *Options) added(full bool) {
	if o.Added != nil {
		o.Added(o.Name, full)
	}
}

// run is Options.Run's default.
func run(ctx context.Context, name string, args ...string) ([]byte, error) {
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		return out, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, msg)
	}
	return out, nil
}

// CheckName refuses a name that cannot be an md array's: 1 to 32 bytes
// (md's metadata 1.2 keeps 32) of letters, digits, '.', '_' and '-', not
// starting with '.' or '-'.
func CheckName(name string) error {
	if name == "" || len(name) > 32 {
		return fmt.Errorf("array name %q: want 1 to 32 bytes", name)
	}
	for i, c := range name {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' && i > 0 || c == '-' && i > 0
		if !ok {
			return fmt.Errorf("array name %q: only letters, digits, '.', '_' and '-' (not first)", name)
		}
	}
	return nil
}

// Path is /dev/md/NAME.
func (o *Options) Path() string {
	dir := o.DevDir
	if dir == "" {
		dir = "/dev"
	}
	return filepath.Join(dir, "md", o.Name)
}

// device is the array's /dev/mdN, if it is assembled.
func (o *Options) device() (string, error) {
	p, err := filepath.EvalSymlinks(o.Path())
	if err != nil {
		return "", fmt.Errorf("%s: %w", o.Path(), ErrNotUp)
	}
	if _, err := os.Stat(filepath.Join(o.SysBlock, filepath.Base(p), "md")); err != nil {
		return "", fmt.Errorf("%s (%s): %w", o.Path(), p, ErrNotUp)
	}
	return p, nil
}

// superblock is what mdadm --examine --export says of a member.
type superblock struct {
	uuid, name string
}

// examine reads dev's md superblock; ok is false when it has none.
func (o *Options) examine(ctx context.Context, dev string) (sb superblock, ok bool, err error) {
	out, err := o.Run(ctx, "mdadm", "--examine", "--export", dev)
	if err != nil {
		if strings.Contains(err.Error(), "No md superblock") {
			return sb, false, nil
		}
		return sb, false, fmt.Errorf("examine %s: %w", dev, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), "=")
		switch k {
		case "MD_UUID":
			sb.uuid = v
		case "MD_NAME":
			sb.name = v
		}
	}
	return sb, sb.uuid != "", nil
}

// named reports whether a superblock's name (HOMEHOST:NAME, or NAME) is
// the array's.
func (sb superblock) named(name string) bool {
	if _, n, ok := strings.Cut(sb.name, ":"); ok {
		return n == name
	}
	return sb.name == name
}

// Up assembles the array over o.Members and returns its device: as it is
// if it is up already; assembled from the members that carry its
// superblock, the others added (a full copy); created over members that
// carry none (in sync if Fresh, else the second is copied from the
// first), with an internal bitmap. A member that carries another array's
// superblock is ErrForeign, and nothing is done.
func Up(ctx context.Context, o Options) (string, error) {
	o.defaults()
	if err := CheckName(o.Name); err != nil {
		return "", err
	}
	if len(o.Members) != 2 {
		return "", fmt.Errorf("array %s: want 2 members, got %d", o.Name, len(o.Members))
	}
	if dev, err := o.device(); err == nil {
		return dev, nil
	}
	var ours, blank []string
	uuid := ""
	for _, m := range o.Members {
		sb, ok, err := o.examine(ctx, m)
		switch {
		case err != nil:
			return "", err
		case !ok:
			blank = append(blank, m)
		case !sb.named(o.Name) || uuid != "" && sb.uuid != uuid:
			return "", fmt.Errorf("array %s: member %s: %w (%s, %s)", o.Name, m, ErrForeign, sb.name, sb.uuid)
		default:
			uuid = sb.uuid
			ours = append(ours, m)
		}
	}
	if len(ours) == 0 {
		args := []string{"--create", o.Path(), "--run", "--level=1", "--raid-devices=2", "--metadata=1.2",
			"--bitmap=internal", "--name=" + o.Name, fmt.Sprintf("--data-offset=%dK", DataOffset>>10)}
		if o.Fresh {
			args = append(args, "--assume-clean")
		}
		if _, err := o.Run(ctx, "mdadm", append(args, o.Members...)...); err != nil {
			return "", fmt.Errorf("create array %s: %w", o.Name, err)
		}
		o.Logger.Info("mirror created", zap.String("array", o.Name), zap.Strings("members", o.Members), zap.Bool("fresh", o.Fresh))
	} else {
		if _, err := o.Run(ctx, "mdadm", append([]string{"--assemble", o.Path(), "--run"}, ours...)...); err != nil {
			return "", fmt.Errorf("assemble array %s: %w", o.Name, err)
		}
		o.Logger.Info("mirror assembled", zap.String("array", o.Name), zap.Strings("members", ours))
		for _, m := range blank {
			if err := Add(ctx, o, m, true); err != nil {
				return "", err
			}
		}
	}
	return o.device()
}

// Add puts member back into the array: from the bitmap (mdadm --re-add:
// only what changed while it was away is copied) unless full, or when md
// refuses that; in full (its superblock wiped, then --add: everything is
// copied) when full: a member that may have lost writes its bitmap does
// not know of. Failed members, and members whose device is gone, are
// removed first; a member in sync is left as it is.
func Add(ctx context.Context, o Options, member string, full bool) error {
	o.defaults()
	st, err := Stat(o)
	if err != nil {
		return err
	}
	stale := false
	for _, m := range st.Members {
		switch {
		case m.Device == member && m.InSync():
			return nil
		case m.Device == member:
			_, _ = o.Run(ctx, "mdadm", o.Path(), "--fail", member) // (it may be failed already)
			stale = true
		case m.Faulty():
			stale = true // (the member's earlier device, gone)
		}
	}
	if stale {
		// Out with every failed member and every one whose device is
		// gone: the slot is the new one's.
		// (Either may find none; the add below says what went wrong.)
		for _, which := range []string{"failed", "detached"} {
			if _, err := o.Run(ctx, "mdadm", o.Path(), "--remove", which); err != nil {
				o.Logger.Debug("mirror: remove", zap.String("array", o.Name), zap.String("which", which), zap.Error(err))
			}
		}
	}
	if !full {
		_, err := o.Run(ctx, "mdadm", o.Path(), "--re-add", member)
		if err == nil {
			o.Logger.Info("mirror member re-added (resyncing what changed)", zap.String("array", o.Name), zap.String("member", member))
			o.added(false)
			return nil
		}
		o.Logger.Warn("mirror member not re-added from the bitmap: adding it in full", zap.String("array", o.Name),
			zap.String("member", member), zap.Error(err))
	}
	if _, err := o.Run(ctx, "mdadm", "--zero-superblock", member); err != nil {
		return fmt.Errorf("array %s: wipe %s before adding it: %w", o.Name, member, err)
	}
	if _, err := o.Run(ctx, "mdadm", o.Path(), "--add", member); err != nil {
		return fmt.Errorf("array %s: add %s: %w", o.Name, member, err)
	}
	o.Logger.Info("mirror member added (copying it in full)", zap.String("array", o.Name), zap.String("member", member))
	o.added(true)
	return nil
}

// Grow makes the array as large as its members allow (mdadm --grow
// --size=max), once both have grown (their attaches resize them when the
// volumes grow), and returns its size in bytes. The bitmap is kept.
func Grow(ctx context.Context, o Options) (int64, error) {
	o.defaults()
	dev, err := o.device()
	if err != nil {
		return 0, err
	}
	if _, err := o.Run(ctx, "mdadm", "--grow", o.Path(), "--size=max"); err != nil {
		return 0, fmt.Errorf("grow array %s: %w", o.Name, err)
	}
	b, err := os.ReadFile(filepath.Join(o.SysBlock, filepath.Base(dev), "size"))
	if err != nil {
		return 0, fmt.Errorf("grow array %s: %w", o.Name, err)
	}
	sectors, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("grow array %s: size %q: %w", o.Name, b, err)
	}
	o.Logger.Info("mirror grown", zap.String("array", o.Name), zap.Int64("bytes", sectors<<9))
	return sectors << 9, nil
}

// Down stops the array (its members stay as they are). One not
// assembled is no error.
func Down(ctx context.Context, o Options) error {
	o.defaults()
	if _, err := o.device(); err != nil {
		return nil
	}
	if _, err := o.Run(ctx, "mdadm", "--stop", o.Path()); err != nil {
		return fmt.Errorf("stop array %s: %w", o.Name, err)
	}
	o.Logger.Info("mirror stopped", zap.String("array", o.Name))
	return nil
}

// Status is what md shows of an array in sysfs.
type Status struct {
	Device string `json:"device"` // /dev/mdN
	// Degraded is the number of members missing or failed.
	Degraded int `json:"degraded"`
	// SyncAction is idle, resync, recover, check or repair;
	// SyncCompleted "DONE / TOTAL" sectors while one runs, else "none".
	SyncAction    string `json:"sync_action"`
	SyncCompleted string `json:"sync_completed"`
	// Mismatches is mismatch_cnt: sectors found to differ by the last
	// check or repair.
	Mismatches uint64   `json:"mismatches"`
	Members    []Member `json:"members"`
}

// Member is one member of an array.
type Member struct {
	Device string `json:"device"` // /dev/nbdN
	// State is md's dev-*/state: in_sync, faulty, spare, write_mostly,
	// blocked, ... (comma separated).
	State string `json:"state"`
}

// InSync reports whether the member holds the whole array.
func (m Member) InSync() bool {
	return strings.Contains(m.State, "in_sync") && !strings.Contains(m.State, "faulty")
}

// Faulty reports whether md failed the member.
func (m Member) Faulty() bool { return strings.Contains(m.State, "faulty") }

// Resyncing reports whether md copies data onto a member (a recovery or
// a resync; not a check).
func (s *Status) Resyncing() bool { return s.SyncAction == "recover" || s.SyncAction == "resync" }

// Healthy reports whether the array has every member in sync and no
// resync running.
func (s *Status) Healthy() bool { return s.Degraded == 0 && s.SyncAction == "idle" }

// Stat reads the array's state from sysfs.
func Stat(o Options) (*Status, error) {
	o.defaults()
	dev, err := o.device()
	if err != nil {
		return nil, err
	}
	md := filepath.Join(o.SysBlock, filepath.Base(dev), "md")
	read := func(name string) string {
		b, _ := os.ReadFile(filepath.Join(md, name))
		return strings.TrimSpace(string(b))
	}
	st := &Status{Device: dev, SyncAction: read("sync_action"), SyncCompleted: read("sync_completed")}
	st.Degraded, _ = strconv.Atoi(read("degraded"))
	st.Mismatches, _ = strconv.ParseUint(read("mismatch_cnt"), 10, 64)
	ents, err := os.ReadDir(md)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "dev-") {
			continue
		}
		st.Members = append(st.Members, Member{Device: filepath.Join(o.DevDir, strings.TrimPrefix(e.Name(), "dev-")),
			State: read(filepath.Join(e.Name(), "state"))})
	}
	return st, nil
}
