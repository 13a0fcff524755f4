// Package mirrortest plays mdadm and md's sysfs for tests of code that
// drives package mirror: set mirror.Options' Run, SysBlock and DevDir
// from a FakeMD.
package mirrortest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// FakeMD plays mdadm over a fake /dev and /sys/block for one array,
// md0 (its /dev/md/NAME link is made for the --name or path it is
// created or assembled with): --create and --assemble make md0 with its
// members in sync; --fail, --remove, --re-add and --add change their
// states; --examine answers from SBs; --grow sets md0's size to
// GrowTo sectors.
type FakeMD struct {
	t    testing.TB
	Root string

	mu     sync.Mutex
	calls  []string
	called chan struct{} // closed (and replaced) at each call
	link   string
	SBs    map[string]string // member -> "UUID NAME"; absent: no superblock
	ReAdd  error             // what --re-add answers
	Member map[string]string // member -> state, while assembled
	GrowTo int64             // sectors
}

// New makes a FakeMD in a temporary folder.
func New(t testing.TB) *FakeMD {
	f := &FakeMD{t: t, Root: t.TempDir(), SBs: map[string]string{}, Member: map[string]string{}, GrowTo: 262144}
	for _, d := range []string{f.SysBlock(), filepath.Join(f.DevDir(), "md")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// SysBlock and DevDir are the fake /sys/block and /dev.
func (f *FakeMD) SysBlock() string { return filepath.Join(f.Root, "sys", "block") }
func (f *FakeMD) DevDir() string   { return filepath.Join(f.Root, "dev") }

// Dev is the fake /dev/NAME; Device makes it (a member's device node).
func (f *FakeMD) Dev(name string) string { return filepath.Join(f.Root, "dev", name) }
func (f *FakeMD) Device(name string) string {
	p := f.Dev(name)
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		f.t.Fatal(err)
	}
	return p
}

// Lock and Unlock guard Member, SBs and ReAdd against Run in another
// goroutine.
func (f *FakeMD) Lock()   { f.mu.Lock() }
func (f *FakeMD) Unlock() { f.mu.Unlock() }

// SetState sets a member's state and shows it in sysfs.
func (f *FakeMD) SetState(member, state string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Member[member] = state
	f.sync()
}

// Sync writes the fake sysfs of md0 from Member (hold Lock).
func (f *FakeMD) Sync() { f.sync() }

func (f *FakeMD) sync() {
	md := filepath.Join(f.SysBlock(), "md0", "md")
	os.RemoveAll(md)
	degraded := 2
	for m, st := range f.Member {
		d := filepath.Join(md, "dev-"+filepath.Base(m))
		if err := os.MkdirAll(d, 0o755); err != nil {
			f.t.Fatal(err)
		}
		os.WriteFile(filepath.Join(d, "state"), []byte(st+"\n"), 0o644)
		if st == "in_sync" {
			degraded--
		}
	}
	os.MkdirAll(md, 0o755)
	for name, v := range map[string]string{"degraded": fmt.Sprint(degraded), "sync_action": "idle", "sync_completed": "none", "mismatch_cnt": "0"} {
		os.WriteFile(filepath.Join(md, name), []byte(v+"\n"), 0o644)
	}
	os.WriteFile(f.Dev("md0"), nil, 0o644) // (the device node)
	if f.link != "" {
		os.Symlink(f.Dev("md0"), f.link)
	}
}

// Run is mirror.Options.Run.
func (f *FakeMD) Run(_ context.Context, name string, args ...string) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, name+" "+strings.Join(args, " "))
	if f.called != nil {
		close(f.called)
		f.called = nil
	}
	switch {
	case args[0] == "--examine":
		sb, ok := f.SBs[args[2]]
		if !ok {
			return nil, fmt.Errorf("mdadm --examine: exit status 1: mdadm: No md superblock detected on %s", args[2])
		}
		uuid, n, _ := strings.Cut(sb, " ")
		return []byte("MD_LEVEL=raid1\nMD_UUID=" + uuid + "\nMD_NAME=" + n + "\n"), nil
	case args[0] == "--create" || args[0] == "--assemble":
		f.link = args[1]
		name := filepath.Base(args[1])
		for _, a := range args {
			if strings.HasPrefix(a, f.Dev("nbd")) {
				f.Member[a] = "in_sync"
				f.SBs[a] = "u-1 host:" + name
			}
		}
		f.sync()
	case args[0] == "--zero-superblock":
		delete(f.SBs, args[1])
	case args[0] == "--grow":
		os.WriteFile(filepath.Join(f.SysBlock(), "md0", "size"), []byte(fmt.Sprintf("%d\n", f.GrowTo)), 0o644)
	case len(args) == 3 && args[1] == "--fail":
		if _, ok := f.Member[args[2]]; ok {
			f.Member[args[2]] = "faulty"
		}
		f.sync()
	case len(args) == 3 && args[1] == "--remove":
		for m, st := range f.Member {
			if st == "faulty" && args[2] == "failed" {
				delete(f.Member, m)
			}
		}
		f.sync()
	case len(args) == 3 && args[1] == "--re-add":
		if f.ReAdd != nil {
			return nil, f.ReAdd
		}
		f.Member[args[2]] = "in_sync"
		f.sync()
	case len(args) == 3 && args[1] == "--add":
		f.Member[args[2]] = "in_sync"
		f.SBs[args[2]] = "u-1 host:" + filepath.Base(args[0])
		f.sync()
	case args[0] == "--stop":
		f.Member = map[string]string{}
		os.RemoveAll(filepath.Join(f.SysBlock(), "md0"))
		os.Remove(f.link)
		os.Remove(f.Dev("md0"))
	}
	return nil, nil
}

// Calls are the calls so far ("mdadm ARGS..."); ResetCalls forgets them.
func (f *FakeMD) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

func (f *FakeMD) ResetCalls() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = nil
}

// WaitCalled waits until a call started with prefix (after "mdadm "), or
// ctx ends: it reports whether one did.
func (f *FakeMD) WaitCalled(ctx context.Context, prefix string) bool {
	for {
		f.mu.Lock()
		if f.called == nil {
			f.called = make(chan struct{})
		}
		ch := f.called
		f.mu.Unlock()
		if f.Called(prefix) {
			return true
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return false
		}
	}
}

// Called reports whether a call started with prefix (after "mdadm ").
func (f *FakeMD) Called(prefix string) bool {
	return slices.ContainsFunc(f.Calls(), func(c string) bool { return strings.HasPrefix(c, "mdadm "+prefix) })
}
