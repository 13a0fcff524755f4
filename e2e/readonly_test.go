package e2e

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReadOnlyExport exports a file with ",ro". Writes fail with EPERM
// (qemu-io, and an NBD WRITE, TRIM and WRITE_ZEROES sent regardless of the
// advertised flags), reads return the file's bytes, and the file is left
// unchanged.
func TestReadOnlyExport(t *testing.T) {
	t.Parallel()
	needSocket(t, "sends NBD commands the server did not advertise (a WRITE to a read-only export) and reads the transmission flags; with --device the kernel is the NBD client and refuses writes to a read-only device itself")
	needTools(t, "qemu-io", "qemu-img")
	dir := t.TempDir()
	golden := filepath.Join(dir, "golden.img")
	content := randomBytes(3, 2<<20)
	if err := os.WriteFile(golden, content, 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256File(t, golden)
	tg := startTarget(t, []string{"golden=" + golden + ",ro"})

	check := func(t *testing.T, at *attacher) {
		// qemu-io opens the export for writing: refused, nothing written.
		r := run(t, cmdTimeout, "qemu-io", "-f", "raw", "-c", "write -P 0x11 0 4096", at.uri("golden"))
		out := r.stdout + r.stderr
		if r.code == 0 || strings.Contains(out, "wrote ") {
			t.Errorf("qemu-io write to a read-only export succeeded: %s", r)
		}
		if !strings.Contains(out, "Operation not permitted") && !strings.Contains(out, "Permission denied") &&
			!strings.Contains(out, "read-only") {
			t.Errorf("qemu-io write: want EPERM (Operation not permitted), EACCES or read-only: %s", r)
		}

		// At the NBD level, whatever the flags say.
		nc := dialNBD(t, at.sock, "golden")
		if nc.flags&nbdFlagReadOnly == 0 {
			t.Errorf("transmission flags %#x lack NBD_FLAG_READ_ONLY", nc.flags)
		}
		for _, c := range []struct {
			name    string
			typ     uint16
			payload []byte
		}{
			{"WRITE", nbdCmdWrite, bytes.Repeat([]byte{0x11}, 4096)},
			{"TRIM", nbdCmdTrim, nil},
			{"WRITE_ZEROES", nbdCmdWriteZeroes, nil},
		} {
			errno, _, err := nc.do(c.typ, 8192, 4096, c.payload)
			if err != nil {
				t.Fatalf("NBD %s: %v", c.name, err)
			}
			if errno != nbdEPERM {
				t.Errorf("NBD %s on a read-only export: error %d, want EPERM (%d, Operation not permitted)", c.name, errno, nbdEPERM)
			}
		}
		// The connection stays usable, and reads return the file.
		if errno, _, err := nc.do(nbdCmdFlush, 0, 0, nil); err != nil || errno != 0 {
			t.Errorf("NBD FLUSH: error %d, %v", errno, err)
		}
		if d := firstDiff(nc.readAll(t), content); d != "" {
			t.Errorf("export read over NBD: %s", d)
		}
		nc.close()
		mustRun(t, cmdTimeout, "qemu-img", "compare", "-f", "raw", "-F", "raw", golden, at.uri(""))
	}

	t.Run("attach --read-only", func(t *testing.T) {
		at := startAttach(t, tg, "golden", "--read-only")
		check(t, at)
		at.stop(t, stopTimeout)
	})
	t.Run("attach", func(t *testing.T) {
		// Attaching a read-only export without --read-only attaches it
		// read-only, as mount does with a write-protected disk.
		at := startAttach(t, tg, "golden")
		check(t, at)
		at.stop(t, stopTimeout)
	})
	tg.stop(t, stopTimeout)
	if got := sha256File(t, golden); got != sum {
		t.Errorf("read-only backing file changed: sha256 %s, want %s", got, sum)
	}
}
