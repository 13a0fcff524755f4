package nbd

// Tests with real NBD clients from Debian: nbdinfo (libnbd-bin), qemu-io
// (qemu-utils) and fio's nbd engine (fio). Install them with
//
//	apt-get install -y qemu-utils libnbd-bin fio

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// need skips the test when a client tool is missing.
func need(t *testing.T, tool string) string {
	t.Helper()
	p, err := exec.LookPath(tool)
	if err != nil {
		t.Skipf("%s is not installed (apt-get install -y qemu-utils libnbd-bin fio): %v", tool, err)
	}
	return p
}

// run runs a tool and returns its combined output; it fails the test on a
// non-zero exit unless allowFail.
func run(t *testing.T, allowFail bool, tool string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, need(t, tool), args...)
	cmd.Dir = t.TempDir() // fio leaves its verify state files in its working directory
	out, err := cmd.CombinedOutput()
	if err != nil && !allowFail {
		t.Fatalf("%s %s: %v\n%s", tool, strings.Join(args, " "), err, out)
	}
	return string(out)
}

type nbdinfoJSON struct {
	Protocol string `json:"protocol"`
	Exports  []struct {
		Name         string `json:"export-name"`
		Description  string `json:"description"`
		Size         uint64 `json:"export-size"`
		ReadOnly     bool   `json:"is_read_only"`
		CanFlush     bool   `json:"can_flush"`
		CanFUA       bool   `json:"can_fua"`
		CanTrim      bool   `json:"can_trim"`
		CanZero      bool   `json:"can_zero"`
		CanMultiConn bool   `json:"can_multi_conn"`
		BlockMin     uint32 `json:"block_size_minimum"`
		BlockPref    uint32 `json:"block_size_preferred"`
		BlockMax     uint32 `json:"block_size_maximum"`
	} `json:"exports"`
}

func nbdinfo(t *testing.T, args ...string) nbdinfoJSON {
	t.Helper()
	out := run(t, false, "nbdinfo", append([]string{"--json"}, args...)...)
	var j nbdinfoJSON
	if err := json.Unmarshal([]byte(out), &j); err != nil {
		t.Fatalf("nbdinfo output: %v\n%s", err, out)
	}
	return j
}

func TestNbdinfo(t *testing.T) {
	need(t, "nbdinfo")
	rw := newMemBackend(4<<20, 3000, 1024)
	ro := newMemBackend(1<<20, 4096, 16)
	ts := startServer(t, Options{Exports: []*Export{
		rwExport("vol", rw),
		{Name: "ro", Description: "read only", Size: 1 << 20, ReadOnly: true, CanFlush: true,
			MinBlock: 512, PrefBlock: 4096, MaxBlock: 64 << 10, Backend: ro},
	}})

	j := nbdinfo(t, ts.uri("vol"))
	if len(j.Exports) != 1 {
		t.Fatalf("%+v", j)
	}
	e := j.Exports[0]
	if j.Protocol != "newstyle-fixed" || e.Name != "vol" || e.Description != "the vol volume" || e.Size != 4<<20 ||
		e.ReadOnly || !e.CanFlush || !e.CanFUA || !e.CanTrim || !e.CanZero || !e.CanMultiConn ||
		e.BlockMin != 1 || e.BlockPref != 4096 || e.BlockMax != 1<<20 {
		t.Errorf("vol: %+v", j)
	}

	j = nbdinfo(t, ts.uri("ro"))
	e = j.Exports[0]
	if e.Name != "ro" || !e.ReadOnly || e.CanTrim || e.CanZero || e.CanFUA || e.CanMultiConn || !e.CanFlush ||
		e.BlockMin != 512 || e.BlockMax != 64<<10 {
		t.Errorf("ro: %+v", j)
	}

	// The default export is the first one.
	j = nbdinfo(t, ts.uri(""))
	if e := j.Exports[0]; e.Size != 4<<20 || e.ReadOnly {
		t.Errorf("default export: %+v", j)
	}

	j = nbdinfo(t, "--list", ts.uri(""))
	if len(j.Exports) != 2 || j.Exports[0].Name != "vol" || j.Exports[1].Name != "ro" ||
		j.Exports[0].Description != "the vol volume" || j.Exports[1].Description != "read only" ||
		!j.Exports[1].ReadOnly {
		t.Errorf("--list: %+v", j)
	}
	out := run(t, false, "nbdinfo", "--list", ts.uri(""))
	if !strings.Contains(out, "export=\"vol\"") || !strings.Contains(out, "description: read only") {
		t.Errorf("nbdinfo --list:\n%s", out)
	}

	// An unknown export is refused.
	out = run(t, true, "nbdinfo", ts.uri("nope"))
	if !strings.Contains(out, "No such file") || !strings.Contains(out, "nope") {
		t.Errorf("nbdinfo of an unknown export:\n%s", out)
	}
	rw.checkReturned(t)
}

// qemuIO runs qemu-io commands on one connection.
func qemuIO(t *testing.T, uri string, cmds ...string) string {
	t.Helper()
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	return run(t, true, "qemu-io", append(args, uri)...)
}

// expectLines checks that out contains each of the lines, in order.
func expectLines(t *testing.T, out string, lines ...string) {
	t.Helper()
	rest := out
	for _, l := range lines {
		i := strings.Index(rest, l)
		if i < 0 {
			t.Fatalf("qemu-io output lacks %q (in order):\n%s", l, out)
		}
		rest = rest[i+len(l):]
	}
}

func TestQemuIO(t *testing.T) {
	need(t, "qemu-io")
	const size = 8 << 20
	be := newMemBackend(size, 3000, 2048)
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})
	want := initial(size)
	fill := func(off, n int, v byte) {
		for i := off; i < off+n; i++ {
			want[i] = v
		}
	}

	out := qemuIO(t, ts.uri("vol"),
		"write -P 0xab 1000 5000",
		"read -P 0xab 1000 5000",
		"write -P 0xcd 7 1",
		"write -f -P 0x5a 12345 777", // FUA
		"read -P 0x5a 12345 777",
		"flush",
		"write -z 20001 10000", // WRITE_ZEROES
		"read -P 0 20001 10000",
		"discard 40960 8192",            // TRIM
		"write -P 0x22 2000001 3000000", // over MaxBlock: split by the client
		"read -P 0x22 2000001 3000000",
		"aio_write -P 0x11 100000 65536",
		"aio_write -P 0x12 200000 65536",
		"aio_write -P 0x13 300000 65536",
		"aio_flush",
		"read -P 0x12 200000 65536",
		"flush",
	)
	expectLines(t, out,
		"wrote 5000/5000 bytes at offset 1000",
		"read 5000/5000 bytes at offset 1000",
		"wrote 1/1 bytes at offset 7",
		"wrote 777/777 bytes at offset 12345",
		"read 777/777 bytes at offset 12345",
		"wrote 10000/10000 bytes at offset 20001",
		"read 10000/10000 bytes at offset 20001",
		"discard 8192/8192 bytes at offset 40960",
		"wrote 3000000/3000000 bytes at offset 2000001",
		"read 3000000/3000000 bytes at offset 2000001",
		"read 65536/65536 bytes at offset 200000",
	)
	if strings.Contains(out, "fail") || strings.Contains(out, "Pattern verification") {
		t.Fatalf("qemu-io:\n%s", out)
	}
	fill(1000, 5000, 0xab)
	fill(7, 1, 0xcd)
	fill(12345, 777, 0x5a)
	fill(20001, 10000, 0)
	fill(40960, 8192, 0)
	fill(2000001, 3000000, 0x22)
	fill(100000, 65536, 0x11)
	fill(200000, 65536, 0x12)
	fill(300000, 65536, 0x13)
	checkBytes(t, be.snapshot(), want)

	if be.flushes.Load() < 2 || be.zeroes.Load() == 0 || be.trims.Load() == 0 || be.fuaWrites.Load() == 0 {
		t.Errorf("flushes %d, write zeroes %d, trims %d, FUA writes %d",
			be.flushes.Load(), be.zeroes.Load(), be.trims.Load(), be.fuaWrites.Load())
	}

	// A second connection sees the data of the first.
	out = qemuIO(t, ts.uri(""), "read -P 0xab 1000 5000", "read -P 0 40960 8192", "read -P 0xcd 7 1")
	if strings.Count(out, "read ") != 3 || strings.Contains(out, "fail") {
		t.Fatalf("qemu-io:\n%s", out)
	}
	waitFor(t, "buffers back", func() bool { return be.lent.Load() == 0 })
	be.checkReturned(t)
}

func TestQemuIOErrors(t *testing.T) {
	need(t, "qemu-io")
	const size = 4 << 20
	be := newMemBackend(size, 4096, 512)
	be.injectError("read", 1<<20, 4096, syscall.EIO)
	be.injectError("write", 2<<20, 4096, syscall.ENOSPC)
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})

	out := qemuIO(t, ts.uri("vol"),
		"read 1048576 4096",
		"read 0 4096",
		"write -P 0x77 2097152 4096",
		"write -P 0x77 3000000 4096",
		"read -P 0x77 3000000 4096",
	)
	expectLines(t, out,
		"read failed: Input/output error",
		"read 4096/4096 bytes at offset 0",
		"write failed: No space left on device",
		"wrote 4096/4096 bytes at offset 3000000",
		"read 4096/4096 bytes at offset 3000000",
	)
	want := initial(size)
	for i := 3000000; i < 3000000+4096; i++ {
		want[i] = 0x77
	}
	checkBytes(t, be.snapshot(), want)
}

func TestQemuIOReadOnly(t *testing.T) {
	need(t, "qemu-io")
	const size = 1 << 20
	be := newMemBackend(size, 4096, 64)
	ts := startServer(t, Options{Exports: []*Export{
		{Name: "ro", Size: size, ReadOnly: true, MaxBlock: 64 << 10, Backend: be},
	}})
	// qemu refuses to write to an export flagged read-only by itself, before
	// anything is sent (the server's own EPERM, for a client that sends the
	// WRITE anyway, is checked by TestReadOnlyRaw): opened read-only (-r) the
	// write command fails, opened read-write the open fails.
	out := run(t, true, "qemu-io", "-r", "-f", "raw", "-c", "write -P 0x99 0 4096", "-c", "read 0 4096", ts.uri("ro"))
	if !strings.Contains(out, "Block node is read-only") && !strings.Contains(out, "Operation not permitted") {
		t.Errorf("qemu-io -r write on a read-only export:\n%s", out)
	}
	expectLines(t, out, "read 4096/4096 bytes at offset 0")
	out = qemuIO(t, ts.uri("ro"), "write -P 0x99 0 4096")
	if !strings.Contains(out, "Could not open image: Permission denied") && !strings.Contains(out, "Operation not permitted") {
		t.Errorf("qemu-io write on a read-only export:\n%s", out)
	}
	checkBytes(t, be.snapshot(), initial(size))
	if be.writes.Load() != 0 {
		t.Errorf("%d writes reached the backend", be.writes.Load())
	}
}

func TestFio(t *testing.T) {
	need(t, "fio")
	if out, _ := exec.Command("fio", "--enghelp").CombinedOutput(); !bytes.Contains(out, []byte("nbd")) {
		t.Skip("this fio has no nbd engine")
	}
	const size = 16 << 20
	be := newMemBackend(size, 4096, 1024)
	be.delay = 200 * time.Microsecond // so that requests overlap in the backend
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})
	out := run(t, false, "fio", "--name=nbd", "--ioengine=nbd", "--uri="+ts.uri("vol"),
		"--rw=randrw", "--bs=4k", "--iodepth=32", "--size=16M",
		"--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--output-format=normal")
	if !strings.Contains(out, "err= 0") {
		t.Fatalf("fio:\n%s", out)
	}
	if p := be.peak.Load(); p < 2 {
		t.Errorf("at most %d request in the backend at once: iodepth 32 was not served concurrently", p)
	} else {
		t.Logf("up to %d requests in the backend at once", p)
	}
	if be.writes.Load() == 0 || be.reads.Load() == 0 {
		t.Errorf("reads %d, writes %d", be.reads.Load(), be.writes.Load())
	}

	// Multi-conn: four jobs, each on its own connection and its own quarter
	// of the export, at once.
	writes := be.writes.Load()
	out = run(t, false, "fio", "--name=multi", "--ioengine=nbd", "--uri="+ts.uri("vol"),
		"--rw=randwrite", "--bs=8k", "--iodepth=8", "--numjobs=4", "--size=4M", "--offset_increment=4M",
		"--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--group_reporting")
	if !strings.Contains(out, "err= 0") || be.writes.Load()-writes < 4*512 {
		t.Fatalf("fio with 4 connections:\n%s", out)
	}
	waitFor(t, "buffers back", func() bool { return be.lent.Load() == 0 })
	be.checkReturned(t)
}
