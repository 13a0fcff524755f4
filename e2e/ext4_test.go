package e2e

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// fuseLoop is an NBD export shown as a file by nbdfuse, with a loop device
// over that file; or, with RBLK_E2E_DEVICE=nbd, the kernel's /dev/nbdN
// that rblk-attach attached (no nbdfuse, no loop device: dev is it).
type fuseLoop struct {
	t        *testing.T
	dir      string // nbdfuse's mount point; the export is dir/nbd
	nbdfuse  *proc
	dev      string // /dev/loopN
	mnt      string // where dev is mounted, if it is
	once     sync.Once
	fuseDown bool
	kernel   bool // dev is rblk-attach's /dev/nbdN
}

// attachFuseLoop runs nbdfuse on uri and sets up a loop device over its
// file. A cleanup tears everything down if the test does not.
func attachFuseLoop(t *testing.T, uri string, readOnly bool) *fuseLoop {
	t.Helper()
	if strings.HasPrefix(uri, "/dev/") {
		f := &fuseLoop{t: t, dev: uri, kernel: true}
		t.Cleanup(f.teardown)
		return f
	}
	f := &fuseLoop{t: t, dir: t.TempDir()}
	mp := filepath.Join(f.dir, "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	pidfile := filepath.Join(f.dir, "nbdfuse.pid")
	args := []string{"-P", pidfile}
	if readOnly {
		args = append(args, "-r")
	}
	args = append(args, mp, uri)
	nbdfuse, _ := toolPath("nbdfuse")
	f.nbdfuse = startProc(t, "nbdfuse", nbdfuse, args...)
	f.dir = mp
	t.Cleanup(f.teardown)
	err := waitUntil(f.nbdfuse, 30*time.Second, func() bool {
		_, perr := os.Stat(pidfile)
		_, ferr := os.Stat(filepath.Join(mp, "nbd"))
		return perr == nil && ferr == nil
	})
	if err != nil {
		t.Fatalf("nbdfuse: %v\n%s", err, f.nbdfuse.out.String())
	}
	largs := []string{"--find", "--show"}
	if readOnly {
		largs = append(largs, "--read-only")
	}
	r := mustRun(t, cmdTimeout, "losetup", append(largs, filepath.Join(mp, "nbd"))...)
	f.dev = strings.TrimSpace(r.stdout)
	if !strings.HasPrefix(f.dev, "/dev/loop") {
		t.Fatalf("losetup printed %q, want /dev/loopN", r.stdout)
	}
	return f
}

// mount mounts the loop device on a fresh folder.
func (f *fuseLoop) mount(opts ...string) string {
	f.t.Helper()
	mnt := f.t.TempDir()
	args := append(append([]string{"-t", "ext4"}, opts...), f.dev, mnt)
	mustRun(f.t, cmdTimeout, "mount", args...)
	f.mnt = mnt
	return mnt
}

// unmount unmounts the file system.
func (f *fuseLoop) unmount() {
	f.t.Helper()
	if f.mnt == "" {
		return
	}
	mustRun(f.t, cmdTimeout, "umount", f.mnt)
	f.mnt = ""
}

// detach unmounts if mounted, detaches the loop device and unmounts
// nbdfuse, which then exits; it fails the test if any step fails.
func (f *fuseLoop) detach() {
	f.t.Helper()
	f.unmount()
	if f.kernel {
		f.dev = "" // (rblk-attach detaches it when it stops)
		return
	}
	if f.dev != "" {
		mustRun(f.t, cmdTimeout, "losetup", "-d", f.dev)
		f.dev = ""
	}
	// The loop device lets go of the file asynchronously: retry while busy.
	deadline := time.Now().Add(patient(30 * time.Second))
	for {
		r := run(f.t, cmdTimeout, "fusermount3", "-u", f.dir)
		if r.code == 0 {
			break
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("fusermount3 -u %s: %s", f.dir, r)
		}
		time.Sleep(200 * time.Millisecond)
	}
	f.fuseDown = true
	select {
	case <-f.nbdfuse.done:
	case <-time.After(patient(30 * time.Second)):
		f.t.Fatalf("nbdfuse did not exit after fusermount3 -u")
	}
	if f.nbdfuse.waitErr != nil {
		f.t.Fatalf("nbdfuse exited with %v\n%s", f.nbdfuse.waitErr, f.nbdfuse.out.String())
	}
}

// teardown is the cleanup: best effort, in order, whatever state the test
// left.
func (f *fuseLoop) teardown() {
	f.once.Do(func() {
		if f.mnt != "" {
			if r, ok := runCmd(f.t, cmdTimeout, "umount", f.mnt); !ok || r.code != 0 {
				runCmd(f.t, cmdTimeout, "umount", "-l", f.mnt)
			}
		}
		if f.kernel {
			return
		}
		if f.dev != "" {
			runCmd(f.t, cmdTimeout, "losetup", "-d", f.dev)
		}
		if !f.fuseDown {
			for i := 0; i < 20; i++ {
				if r, ok := runCmd(f.t, cmdTimeout, "fusermount3", "-u", f.dir); ok && r.code == 0 {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if !f.nbdfuse.exited() {
				runCmd(f.t, cmdTimeout, "fusermount3", "-u", "-z", f.dir)
			}
		}
	})
}

// TestExt4OverNbdfuse makes an ext4 file system on the export through
// nbdfuse and a loop device (with RBLK_E2E_DEVICE=nbd: on the kernel's
// /dev/nbdN itself), writes files, stops everything, checks the backing
// file with e2fsck, then starts everything again (read-only) and checks
// every file's checksum.
func TestExt4OverNbdfuse(t *testing.T) {
	t.Parallel()
	needTools(t, "nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "e2fsck", "mount", "umount")
	needRootAndFUSE(t)
	dir := t.TempDir()
	backing := filepath.Join(dir, "vol.img")
	export := "vol=" + backing + ",size=64M"

	tg := startTarget(t, []string{export})
	at := startAttach(t, tg, "vol")
	fl := attachFuseLoop(t, at.uri("vol"), false)
	mustRun(t, cmdTimeout, "mkfs.ext4", "-q", fl.dev)
	mnt := fl.mount()

	rng := rand.New(rand.NewPCG(7, 11))
	// Files up to 512 KiB; under emulation up to 128 KiB, for time (there
	// the sync of 9 MiB through FUSE, a loop device and NBD took minutes).
	most := 512 << 10
	if emulated() {
		most = 128 << 10
	}
	sums := map[string]string{}
	if err := os.Mkdir(filepath.Join(mnt, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 40; i++ {
		name := fmt.Sprintf("file-%02d.bin", i)
		if i%4 == 3 {
			name = filepath.Join("sub", name)
		}
		size := rng.IntN(most)
		if i%10 == 0 {
			size = rng.IntN(10) // a few tiny ones, including empty
		}
		data := make([]byte, size)
		for j := range data {
			data[j] = byte(rng.Uint32())
		}
		if err := os.WriteFile(filepath.Join(mnt, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
		h := sha256.Sum256(data)
		sums[name] = hex.EncodeToString(h[:])
	}
	mustRun(t, cmdTimeout, "sync", "-f", mnt)
	fl.detach()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)

	// The backing file alone holds a consistent file system.
	if r := run(t, cmdTimeout, "e2fsck", "-fn", backing); r.code != 0 {
		t.Fatalf("e2fsck -fn %s: %s", backing, r)
	}
	before := sha256File(t, backing)

	// Again, read-only all the way down: every file is there, intact.
	tg = startTarget(t, []string{export})
	at = startAttach(t, tg, "vol", "--read-only")
	fl = attachFuseLoop(t, at.uri("vol"), true)
	mnt = fl.mount("-o", "ro")
	for name, want := range sums {
		data, err := os.ReadFile(filepath.Join(mnt, name))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		h := sha256.Sum256(data)
		if got := hex.EncodeToString(h[:]); got != want {
			t.Errorf("%s: sha256 %s, want %s", name, got, want)
		}
	}
	entries, err := os.ReadDir(mnt)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) < 10 {
		t.Errorf("root folder has %d entries after the restart", len(entries))
	}
	fl.detach()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	if after := sha256File(t, backing); after != before {
		t.Errorf("backing file changed during the read-only mount: sha256 %s, was %s", after, before)
	}
}
