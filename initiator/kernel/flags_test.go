package kernel

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/rblk/rblk/initiator/nbd"
)

func TestServerFlags(t *testing.T) {
	all := nbd.Export{CanFlush: true, CanFUA: true, CanTrim: true, CanZero: true, MultiConn: true}
	ro := all
	ro.ReadOnly = true
	single := nbd.Export{CanFlush: true}
	for _, c := range []struct {
		name  string
		e     nbd.Export
		conns int
		want  uint64
	}{
		{"read-write", all, 4, 0x16d},
		{"read-only: no TRIM nor WRITE_ZEROES", ro, 2, FlagHasFlags | FlagReadOnly | FlagSendFlush | FlagSendFUA | FlagCanMultiConn},
		{"one connection", single, 1, FlagHasFlags | FlagSendFlush},
	} {
		got, err := ServerFlags(&c.e, c.conns)
		if err != nil || got != c.want {
			t.Errorf("%s: %#x, %v; want %#x", c.name, got, err, c.want)
		}
	}
	if _, err := ServerFlags(&single, 2); err == nil {
		t.Error("two connections to an export without MultiConn: no error")
	}
	if _, err := ServerFlags(nil, 1); err == nil {
		t.Error("nil export: no error")
	}
}

func TestBlockSize(t *testing.T) {
	for _, c := range []struct {
		size uint64
		want uint32
		bs   uint32
	}{
		{512 << 20, 0, 4096},
		{512 << 20, 1024, 1024},
		{4096*10 + 2048, 0, 2048},
		{4096*10 + 512, 0, 512},
	} {
		got, err := blockSize(c.size, c.want)
		if err != nil || got != c.bs {
			t.Errorf("blockSize(%d, %d) = %d, %v; want %d", c.size, c.want, got, err, c.bs)
		}
	}
	for _, c := range []struct {
		size uint64
		want uint32
	}{{1000, 0}, {0, 0}, {1 << 20, 8192}, {1 << 20, 256}, {1 << 20, 3000}} {
		if got, err := blockSize(c.size, c.want); err == nil {
			t.Errorf("blockSize(%d, %d) = %d, no error", c.size, c.want, got)
		}
	}
}

func TestDefaultConnections(t *testing.T) {
	if n := DefaultConnections(); n != min(runtime.NumCPU(), MaxConnections) || n < 1 {
		t.Errorf("DefaultConnections() = %d with %d CPUs", n, runtime.NumCPU())
	}
}

func TestParseDevice(t *testing.T) {
	for in, want := range map[string]int{"auto": -1, "": -1, "/dev/nbd0": 0, "nbd12": 12, "/dev/nbd3": 3} {
		if got, err := ParseDevice(in); err != nil || got != want {
			t.Errorf("ParseDevice(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"/dev/sda", "nbd", "/dev/nbd0p1", "nbd01", "nbd-1", "/dev/nbdx", "nbd99999999999"} {
		if got, err := ParseDevice(in); err == nil {
			t.Errorf("ParseDevice(%q) = %d, no error", in, got)
		}
	}
	// A symlink to a device is followed.
	dir := t.TempDir()
	target := filepath.Join(dir, "nbd5")
	if err := os.WriteFile(target, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "mydisk")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if got, err := ParseDevice(link); err != nil || got != 5 {
		t.Errorf("ParseDevice(symlink to nbd5) = %d, %v", got, err)
	}
}

func TestStat(t *testing.T) {
	root := t.TempDir()
	defer func(b, m, p string) { sysBlock, sysModule, procDir = b, m, p }(sysBlock, sysModule, procDir)
	sysBlock, sysModule, procDir = filepath.Join(root, "block"), filepath.Join(root, "module", "nbd"), filepath.Join(root, "proc")

	if _, err := Stat("/dev/nbd0"); err != ErrNoModule {
		t.Errorf("no module: %v", err)
	}
	write := func(name, content string) {
		p := filepath.Join(sysBlock, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(sysModule, 0o755); err != nil {
		t.Fatal(err)
	}
	write("nbd0/size", "0\n")
	write("nbd1/size", "1048576\n")
	write("nbd1/pid", "4242\n")
	write("nbd1/backend", "rblk:vol@127.0.0.1:7480\n")

	// The kernel names the thread that attached nbd2: its process is
	// shown.
	write("nbd2/pid", "4243\n")
	if err := os.MkdirAll(filepath.Join(procDir, "4243"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(procDir, "4243", "status"), []byte("Name:\trblk-attach\nTgid:\t4200\nPid:\t4243\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if st, err := Stat("nbd2"); err != nil || st.PID != 4200 {
		t.Errorf("nbd2, attached by thread 4243 of process 4200: %+v, %v", st, err)
	}
	st, err := Stat("nbd0")
	if err != nil || st.Attached || st.Path != "/dev/nbd0" || st.Size != 0 {
		t.Errorf("nbd0: %+v, %v", st, err)
	}
	st, err = Stat("/dev/nbd1")
	if err != nil || !st.Attached || st.PID != 4242 || st.Backend != "rblk:vol@127.0.0.1:7480" || st.Size != 512<<20 {
		t.Errorf("nbd1: %+v, %v", st, err)
	}
	if _, err := Stat("/dev/nbd9"); err == nil || err == ErrNoModule {
		t.Errorf("missing device: %v", err)
	}
	if _, err := Stat("auto"); err == nil {
		t.Error("Stat(auto): no error")
	}
}
