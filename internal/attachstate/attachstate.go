package attachstate

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// DefaultDir is where rblk-attach keeps its status files.
const DefaultDir = "/run/rblk/attach"

// State is where an attach is in its life.
type State string

// The states of an attach.
const (
	// Connecting: opening the volume on the target, attaching the device.
	Connecting State = "connecting"
	// Up: attached and serving.
	Up State = "up"
	// Reconnecting: the connection to the target is lost; IO waits.
	Reconnecting State = "reconnecting"
	// Draining: stopping; requests in flight finish, the volume flushes.
	Draining State = "draining"
	// Failed: the session is lost for good; the process is exiting.
	Failed State = "failed"
)

// Entry is one attach: the JSON of its status file, and an element of
// rblk-attach status --json.
type Entry struct {
	PID int `json:"pid"`
	// Device is the block device (/dev/nbdN, /dev/ublkbN), Socket the NBD
	// listen address (unix:PATH or tcp:HOST:PORT): one of them is set
	// once attached.
	Device    string `json:"device,omitempty"`
	Socket    string `json:"socket,omitempty"`
	Export    string `json:"export"`
	Target    string `json:"target"`
	Transport string `json:"transport"`
	State     State  `json:"state"`
	// Reconnects counts the connections to the target made again after
	// one was lost.
	Reconnects int `json:"reconnects"`
	// Since is when the attach entered State; Started when the process
	// began attaching.
	Since   time.Time `json:"since"`
	Started time.Time `json:"started"`
	// Queues is the number of connections to the target.
	Queues   int    `json:"queues"`
	ReadOnly bool   `json:"read_only"`
	Size     uint64 `json:"size"`
	// HostID is the host ID the attach opened the export as; Instance
	// its attach instance, 16 hex digits (see initiator.Options.Instance):
	// the same for all its reconnects, another for each attach. Empty in
	// files of an older rblk-attach.
	HostID   string `json:"host_id,omitempty"`
	Instance string `json:"instance,omitempty"`

	// StartTicks is the process's start time in clock ticks since boot
	// (/proc/PID/stat), which tells a live process from a reused pid.
	StartTicks uint64 `json:"start_ticks"`
}

// Record is this process's status file.
type Record struct {
	mu   sync.Mutex
	path string
	e    Entry
	gone bool
}

// Create writes this process's status file in dir (created if missing,
// mode 0755) with e, whose PID, StartTicks, Started and Since it fills in.
func Create(dir string, e Entry) (*Record, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create the status folder: %w", err)
	}
	e.PID = os.Getpid()
	ticks, err := startTicks(e.PID)
	if err != nil {
		return nil, err
	}
	e.StartTicks = ticks
	now := time.Now().UTC()
	if e.Started.IsZero() {
		e.Started = now
	}
	if e.Since.IsZero() {
		e.Since = now
	}
	r := &Record{path: filepath.Join(dir, strconv.Itoa(e.PID)+".json"), e: e}
	if err := r.write(); err != nil {
		return nil, err
	}
	return r, nil
}

// Update changes the entry with f and writes it; Since is set to now when
// f changes State. After Remove it does nothing.
func (r *Record) Update(f func(*Entry)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gone {
		return nil
	}
	old := r.e.State
	f(&r.e)
	if r.e.State != old {
		r.e.Since = time.Now().UTC()
	}
	return r.write()
}

// Entry returns a copy of the entry.
func (r *Record) Entry() Entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.e
}

// Path is the status file's path.
func (r *Record) Path() string { return r.path }

// Remove deletes the status file; later Updates do nothing.
func (r *Record) Remove() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gone {
		return nil
	}
	r.gone = true
	if err := os.Remove(r.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the status file: %w", err)
	}
	return nil
}

// write replaces the file atomically: a reader sees the old entry or the
// new one, never a part. r.mu is held.
func (r *Record) write() error {
	b, err := json.MarshalIndent(r.e, "", "  ")
	if err != nil {
		return fmt.Errorf("encode the status: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(r.path), "."+filepath.Base(r.path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write the status file: %w", err)
	}
	_, err = tmp.Write(append(b, '\n'))
	if err == nil {
		err = tmp.Chmod(0o644)
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), r.path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("write the status file %s: %w", r.path, err)
	}
	return nil
}

// List returns the attaches whose status files are in dir, by pid. It
// removes the files of processes that are gone (best effort: a reader
// without write access leaves them) and skips files it cannot parse. A
// missing dir is no attach.
func List(dir string) ([]Entry, error) {
	des, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the status folder: %w", err)
	}
	var out []Entry
	for _, de := range des {
		name := de.Name()
		pid, err := strconv.Atoi(strings.TrimSuffix(name, ".json"))
		if !strings.HasSuffix(name, ".json") || err != nil || pid <= 0 {
			continue
		}
		path := filepath.Join(dir, name)
		b, err := os.ReadFile(path)
		if err != nil {
			continue // removed meanwhile
		}
		var e Entry
		if err := json.Unmarshal(b, &e); err != nil || e.PID != pid {
			continue
		}
		if !Alive(e) {
			os.Remove(path)
			continue
		}
		out = append(out, e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out, nil
}

// Alive reports whether the process of e still runs (and is the one that
// wrote e, not another with its pid).
func Alive(e Entry) bool {
	ticks, err := startTicks(e.PID)
	return err == nil && ticks == e.StartTicks
}

// startTicks reads field 22 of /proc/PID/stat, the process's start time;
// a zombie counts as gone.
func startTicks(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("process %d: %w", pid, err)
	}
	// "pid (comm) state ppid ...": comm may hold spaces and parentheses.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("process %d: unexpected /proc/%d/stat %q", pid, pid, s)
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state); field 22 is f[19].
	if len(f) < 20 {
		return 0, fmt.Errorf("process %d: short /proc/%d/stat", pid, pid)
	}
	if f[0] == "Z" || f[0] == "X" {
		return 0, fmt.Errorf("process %d has exited", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}
