package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

const (
	cmdTimeout  = 2 * time.Minute
	stopTimeout = 60 * time.Second
)

// qop is one qemu-io command and what it does to the expected image.
type qop struct {
	kind    byte // 'w' write a pattern, 'z' write zeroes, 'd' discard, 'f' flush, 'r' read a pattern
	off, n  int
	pattern byte
	fua     bool
}

func (o qop) command() string {
	switch o.kind {
	case 'w':
		fua := ""
		if o.fua {
			fua = "-f "
		}
		return fmt.Sprintf("write %s-P 0x%02x %d %d", fua, o.pattern, o.off, o.n)
	case 'z':
		return fmt.Sprintf("write -z %d %d", o.off, o.n)
	case 'd':
		return fmt.Sprintf("discard %d %d", o.off, o.n)
	case 'f':
		return "flush"
	case 'r':
		return fmt.Sprintf("read -P 0x%02x %d %d", o.pattern, o.off, o.n)
	}
	panic("bad op")
}

// apply does o to the expected image. rblk zeroes discarded ranges (it
// punches holes in the backing file), so a discard reads back as zeroes.
func (o qop) apply(img []byte) {
	switch o.kind {
	case 'w':
		for i := o.off; i < o.off+o.n; i++ {
			img[i] = o.pattern
		}
	case 'z', 'd':
		clear(img[o.off : o.off+o.n])
	}
}

// qemuIO runs qemu-io on uri with one -c per op and fails t unless every
// command succeeded.
func qemuIO(t *testing.T, uri string, ops []qop) {
	t.Helper()
	args := []string{"-f", "raw"}
	for _, o := range ops {
		args = append(args, "-c", o.command())
	}
	args = append(args, uri)
	r := mustRun(t, cmdTimeout, "qemu-io", args...)
	out := r.stdout + r.stderr
	for _, bad := range []string{"failed", "error", "Pattern verification"} {
		if strings.Contains(strings.ToLower(out), strings.ToLower(bad)) {
			t.Fatalf("qemu-io output mentions %q:\n%s", bad, out)
		}
	}
}

// readChecks makes 'r' ops that check every run of equal bytes of want
// inside the ranges that ops touched.
func readChecks(want []byte, ops []qop) []qop {
	touched := make([]bool, len(want))
	for _, o := range ops {
		if o.kind == 'w' || o.kind == 'z' || o.kind == 'd' {
			for i := o.off; i < o.off+o.n; i++ {
				touched[i] = true
			}
		}
	}
	var out []qop
	for i := 0; i < len(want); {
		if !touched[i] {
			i++
			continue
		}
		j := i
		for j < len(want) && touched[j] && want[j] == want[i] {
			j++
		}
		out = append(out, qop{kind: 'r', off: i, n: j - i, pattern: want[i]})
		i = j
	}
	return out
}

// TestQemuIO writes patterns, zeroes and discards at unaligned and
// chunk-crossing offsets with qemu-io (chunks of 64 KiB), then checks that
// the backing file holds exactly the expected bytes: after FLUSH while
// everything runs, and again after rblk-attach and rblkd stopped. It runs
// once with a cache that holds the whole volume and once with a cache of
// four chunks, so that the same writes go through evictions.
func TestQemuIO(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	for _, tc := range []struct{ name, cache string }{
		{"cache-holds-all", "16M"},
		{"cache-of-4-chunks", "256K"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const size = 1 << 20 // 16 chunks of 64 KiB
			dir := t.TempDir()
			backing := filepath.Join(dir, "vol.img")
			initial := randomBytes(1, size)
			if err := os.WriteFile(backing, initial, 0o600); err != nil {
				t.Fatal(err)
			}
			want := append([]byte(nil), initial...)

			tg := startTarget(t, []string{"vol=" + backing}, "--chunk-size", "64K", "--cache-size", tc.cache)
			at := startAttach(t, tg, "vol")

			ops := []qop{
				{kind: 'w', pattern: 0x5a, off: 65530, n: 20}, // crosses the first chunk boundary
				{kind: 'r', pattern: 0x5a, off: 65530, n: 20},
				{kind: 'w', pattern: 0x11, off: 1000, n: 5000},    // unaligned, inside a chunk
				{kind: 'w', pattern: 0x22, off: 65000, n: 131072}, // spans chunks 0, 1 and 2
				{kind: 'w', pattern: 0x33, off: 131071, n: 2},     // one byte either side of a boundary
				{kind: 'r', pattern: 0x11, off: 1000, n: 5000},
				{kind: 'f'},
				{kind: 'z', off: 70000, n: 10000},   // write zeroes, unaligned
				{kind: 'z', off: 126976, n: 16384},  // write zeroes across a boundary
				{kind: 'd', off: 262144, n: 131072}, // discard two whole chunks
				{kind: 'd', off: 400000, n: 1000},   // discard, unaligned
				{kind: 'w', pattern: 0x44, off: 500000, n: 4096, fua: true},
				{kind: 'w', pattern: 0x77, off: 600000, n: 120000},  // chunks 9 and 10
				{kind: 'w', pattern: 0x55, off: size - 100, n: 100}, // the last bytes
				{kind: 'r', pattern: 0x55, off: size - 100, n: 100},
				{kind: 'f'},
			}
			if at.dev != "" {
				// A block device takes a discard in whole logical blocks
				// only (BLKDISCARD: EINVAL): the unaligned discard is
				// the socket run's.
				ops = slices.DeleteFunc(ops, func(o qop) bool { return o.kind == 'd' && (o.off%4096 != 0 || o.n%4096 != 0) })
			}
			for _, o := range ops {
				o.apply(want)
			}
			qemuIO(t, at.uri("vol"), ops)

			// FLUSH made every write durable: the file has them now.
			got, err := os.ReadFile(backing)
			if err != nil {
				t.Fatal(err)
			}
			if d := firstDiff(got, want); d != "" {
				t.Fatalf("backing file after FLUSH, while running: %s", d)
			}

			// A new connection, by the default export, reads the same.
			qemuIO(t, at.uri(""), readChecks(want, ops))
			nc := dialNBD(t, at.sock, "vol")
			if d := firstDiff(nc.readAll(t), want); d != "" {
				t.Fatalf("export read back over NBD: %s", d)
			}
			nc.close()

			at.stop(t, stopTimeout)
			tg.stop(t, stopTimeout)
			got, err = os.ReadFile(backing)
			if err != nil {
				t.Fatal(err)
			}
			if d := firstDiff(got, want); d != "" {
				t.Fatalf("backing file after both stopped: %s", d)
			}
		})
	}
}

// nbdinfoExport is what nbdinfo --json says of an export.
type nbdinfoExport struct {
	Name         string `json:"export-name"`
	Size         uint64 `json:"export-size"`
	ReadOnly     bool   `json:"is_read_only"`
	CanFlush     bool   `json:"can_flush"`
	CanFUA       bool   `json:"can_fua"`
	CanTrim      bool   `json:"can_trim"`
	CanZero      bool   `json:"can_zero"`
	CanMultiConn bool   `json:"can_multi_conn"`
}

func nbdinfo(t *testing.T, uri string) nbdinfoExport {
	t.Helper()
	r := mustRun(t, cmdTimeout, "nbdinfo", "--json", uri)
	var info struct {
		Exports []nbdinfoExport `json:"exports"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &info); err != nil {
		t.Fatalf("nbdinfo --json %s: %v\n%s", uri, err, r.stdout)
	}
	if len(info.Exports) != 1 {
		t.Fatalf("nbdinfo --json %s: %d exports, want 1\n%s", uri, len(info.Exports), r.stdout)
	}
	return info.Exports[0]
}

// TestNbdinfo checks the flags rblk-attach's NBD server advertises, by the
// volume's name and as the default export, for a writable and a read-only
// volume.
func TestNbdinfo(t *testing.T) {
	t.Parallel()
	needSocket(t, "the flags of rblk-attach's NBD server as a userspace client sees them; the kernel's device shows its own (queue/write_cache, read_only in sysfs)")
	needTools(t, "nbdinfo")
	dir := t.TempDir()
	golden := filepath.Join(dir, "golden.img")
	if err := os.WriteFile(golden, randomBytes(2, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=8M", "golden=" + golden + ",ro"})
	rw := startAttach(t, tg, "vol")
	ro := startAttach(t, tg, "golden", "--read-only")

	for _, name := range []string{"vol", ""} {
		t.Run("rw/by-name="+name, func(t *testing.T) {
			x := nbdinfo(t, rw.uri(name))
			want := nbdinfoExport{Name: x.Name, Size: 8 << 20, CanFlush: true, CanFUA: true, CanTrim: true, CanZero: true, CanMultiConn: true}
			if x != want {
				t.Errorf("nbdinfo %s:\n got %+v\nwant %+v", rw.uri(name), x, want)
			}
		})
	}
	for _, name := range []string{"golden", ""} {
		t.Run("ro/by-name="+name, func(t *testing.T) {
			x := nbdinfo(t, ro.uri(name))
			want := nbdinfoExport{Name: x.Name, Size: 1 << 20, ReadOnly: true, CanFlush: true, CanMultiConn: true}
			if x != want {
				t.Errorf("nbdinfo %s:\n got %+v\nwant %+v", ro.uri(name), x, want)
			}
		})
	}
	// A name that is not the attached volume is refused.
	if r := run(t, cmdTimeout, "nbdinfo", "--json", rw.uri("nope")); r.code == 0 {
		t.Errorf("nbdinfo of export \"nope\" succeeded: %s", r)
	}
	ro.stop(t, stopTimeout)
	rw.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// fioResult is the part of fio's JSON output the tests read.
type fioResult struct {
	Jobs []struct {
		Name  string `json:"jobname"`
		Error int    `json:"error"`
		Read  struct {
			IOBytes int64 `json:"io_bytes"`
		} `json:"read"`
		Write struct {
			IOBytes int64 `json:"io_bytes"`
		} `json:"write"`
	} `json:"jobs"`
}

// runFio runs one fio job with the nbd engine (libaio on a block device:
// fioTarget) and fails t unless it passed with no verify error. It returns
// the parsed JSON.
func runFio(t *testing.T, uri string, args ...string) fioResult {
	t.Helper()
	all := append(append([]string{"--name=rblk"}, fioTarget(uri)...), append([]string{"--output-format=json",
		"--verify_fatal=1", "--exitall_on_error=1", "--verify_state_save=0"}, args...)...)
	return checkFio(t, run(t, 4*time.Minute, "fio", all...))
}

// TestFio runs fio's nbd engine, random reads and writes at queue depth 32
// with crc32c verification.
func TestFio(t *testing.T) {
	t.Parallel()
	needTools(t, "fio")
	dir := t.TempDir()
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=32M"})
	at := startAttach(t, tg, "vol", "--queues", "2")
	res := runFio(t, at.uri("vol"), "--rw=randrw", "--bs=4k", "--iodepth=32", "--verify=crc32c", "--size=16M")
	// Its reads include the verification of every block it wrote.
	if j := res.Jobs[0]; j.Write.IOBytes == 0 || j.Read.IOBytes <= j.Write.IOBytes {
		t.Errorf("fio read %d and wrote %d bytes: want writes, and more reads (verification reads all written)", j.Read.IOBytes, j.Write.IOBytes)
	}
	// The I/O went over the transport as one-sided operations.
	if v := metric(t, at.metrics, "rblk_attach_rdma_ops_total"); v == 0 {
		t.Errorf("rblk_attach_rdma_ops_total = 0 after fio")
	}
	if v := metric(t, at.metrics, "rblk_attach_rdma_bytes_total"); v < 16<<20 {
		t.Errorf("rblk_attach_rdma_bytes_total = %v after fio, want at least 16 MiB", v)
	}
	if e2e.transport == "rdma" {
		// Both ends see the RDMA device's port up, and its packet
		// counters moved.
		for _, addr := range []string{tg.metrics, at.metrics} {
			checkRDMAPort(t, addr)
		}
	}
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// TestCacheSmallerThanVolume writes and verifies a 64 MiB volume through a
// 16 MiB cache of 1 MiB chunks: the target must evict chunks and revoke the
// initiator's grants on them, and no byte may be lost on the way. Under
// emulation the same at a quarter of the size (16 MiB through 4 MiB of
// 256 KiB chunks: 64 chunks through 16 slots as well), for time: there
// the whole took eight minutes.
func TestCacheSmallerThanVolume(t *testing.T) {
	t.Parallel()
	needTools(t, "fio")
	size, cache, chunk := int64(64<<20), "16M", "1M"
	if emulated() {
		size, cache, chunk = 16<<20, "4M", "256K"
	}
	dir := t.TempDir()
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + fmt.Sprintf(",size=%d", size)},
		"--cache-size", cache, "--chunk-size", chunk)
	at := startAttach(t, tg, "vol")
	res := runFio(t, at.uri("vol"), "--rw=randwrite", "--bs=16k", "--iodepth=16", "--verify=crc32c",
		fmt.Sprintf("--size=%d", size), "--do_verify=1")
	if j := res.Jobs[0]; j.Write.IOBytes != size || j.Read.IOBytes < size {
		t.Errorf("fio wrote %d and read (verified) %d bytes, want %d both", j.Write.IOBytes, j.Read.IOBytes, size)
	}
	m := scrape(t, tg.metrics)
	for _, name := range []string{"rblkd_cache_evictions_total", "rblkd_revokes_total", "rblkd_cache_loads_total"} {
		v, ok := metricSum(m, name)
		if !ok || v <= 0 {
			t.Errorf("%s = %v (present %v), want > 0", name, v, ok)
		}
	}
	used, _ := metricSum(m, "rblkd_cache_used_bytes")
	budget, ok := metricSum(m, "rblkd_cache_budget_bytes")
	if !ok || budget != float64(size/4) || used > budget {
		t.Errorf("rblkd_cache_used_bytes %v, rblkd_cache_budget_bytes %v: want used <= budget = %s", used, budget, cache)
	}
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// TestRequestLargerThanCache sends one NBD write that spans five chunks to
// a target whose cache holds four. The request must complete, whether the
// initiator splits it or the NBD server advertises a maximum block size
// that makes the client split it; it must not hang.
func TestRequestLargerThanCache(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	dir := t.TempDir()
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=1M"},
		"--chunk-size", "64K", "--cache-size", "256K")
	at := startAttach(t, tg, "vol")
	const off, n = 600000, 300000 // chunks 9 to 13
	r := runWithin(t, 30*time.Second, "qemu-io", "-f", "raw",
		"-c", fmt.Sprintf("write -P 0x77 %d %d", off, n), "-c", fmt.Sprintf("read -P 0x77 %d %d", off, n), at.uri("vol"))
	if r == nil {
		t.Fatalf("a %d-byte write over 5 chunks of 64 KiB through a cache of 4 chunks did not complete in 30s "+
			"(rblkd_revokes_total %v, rblkd_cache_evictions_total %v: grants and revokes go round without progress)",
			n, metric(t, tg.metrics, "rblkd_revokes_total"), metric(t, tg.metrics, "rblkd_cache_evictions_total"))
	}
	if r.code != 0 || strings.Contains(r.stdout+r.stderr, "failed") {
		t.Fatalf("qemu-io: %s", r)
	}
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}
