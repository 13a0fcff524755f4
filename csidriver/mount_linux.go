package csidriver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// mounted reports whether path is a mount point (in /proc/self/mountinfo).
func mounted(path string) (bool, error) {
	path = filepath.Clean(path)
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if mountPoint(sc.Text()) == path {
			return true, nil
		}
	}
	return false, sc.Err()
}

// mountPoint is the mount point of a line of mountinfo (its fifth field,
// octal escapes undone).
func mountPoint(line string) string {
	fields := strings.Fields(line)
	if len(fields) < 5 {
		return ""
	}
	return unescapeMountinfo(fields[4])
}

func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

// unmountAndRemove unmounts path while it is a mount point (a path
// mounted twice is unmounted twice), then removes it. A path not there
// is no error.
func unmountAndRemove(path string) error {
	if err := unmountAll(path); err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// unmountAll unmounts path while it is a mount point, and keeps it.
func unmountAll(path string) error {
	if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	for range 8 {
		m, err := mounted(path)
		if err != nil || !m {
			return err
		}
		if err := unix.Unmount(path, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("umount %s: %w", path, err)
		}
	}
	return fmt.Errorf("%s is still mounted", path)
}

// run runs a command, its output in the error.
func run(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// deviceFS is the file system on dev ("" if blkid finds none).
func deviceFS(ctx context.Context, dev string) (string, error) {
	out, err := exec.CommandContext(ctx, "blkid", "-p", "-s", "TYPE", "-o", "value", dev).Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 2 {
		return "", nil // (nothing found)
	}
	if err != nil {
		return "", fmt.Errorf("blkid %s: %w", dev, err)
	}
	return strings.TrimSpace(string(out)), nil
}

// mkfs makes a file system of kind fs on dev.
func mkfs(ctx context.Context, fs, dev string) error {
	var err error
	switch fs {
	case "ext4":
		_, err = run(ctx, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", dev)
	case "xfs":
		_, err = run(ctx, "mkfs.xfs", "-q", "-K", dev)
	default:
		err = fmt.Errorf("file system %q: rblk-csi makes ext4 or xfs", fs)
	}
	return err
}

// mountFS mounts dev (a file system of kind fs) at path with flags.
func mountFS(dev, path, fs string, flags []string) error {
	args := []string{"-t", fs}
	if len(flags) > 0 {
		args = append(args, "-o", strings.Join(flags, ","))
	}
	_, err := run(context.Background(), "mount", append(args, dev, path)...)
	return err
}

// bindMount mounts src at target (a bind mount), read-only if ro.
func bindMount(src, target string, ro bool) error {
	if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s at %s: %w", src, target, err)
	}
	if ro {
		if err := unix.Mount("", target, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
			unix.Unmount(target, 0)
			return fmt.Errorf("make %s read-only: %w", target, err)
		}
	}
	return nil
}

// touch makes path a regular file if it is not there (a block volume's
// target path).
func touch(path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY|unix.O_NOFOLLOW, 0o640)
	if err != nil {
		return err
	}
	return f.Close()
}

// deviceSize is a block device's size in bytes.
func deviceSize(dev string) (int64, error) {
	f, err := os.Open(dev)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var size uint64
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&size))); e != 0 {
		return 0, fmt.Errorf("BLKGETSIZE64 %s: %w", dev, e)
	}
	return int64(size), nil
}

// growFS grows the file system fs on dev, mounted at path, to the
// device's size.
func growFS(ctx context.Context, fs, dev, path string) error {
	var err error
	switch fs {
	case "ext4", "ext3", "ext2":
		_, err = run(ctx, "resize2fs", dev)
	case "xfs":
		_, err = run(ctx, "xfs_growfs", path)
	default:
		err = fmt.Errorf("cannot grow a %q file system", fs)
	}
	return err
}
