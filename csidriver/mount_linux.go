package csidriver

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

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
	if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	for range 8 {
		m, err := mounted(path)
		if err != nil {
			return err
		}
		if !m {
			break
		}
		if err := unix.Unmount(path, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("umount %s: %w", path, err)
		}
	}
	if m, _ := mounted(path); m {
		return fmt.Errorf("%s is still mounted", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
