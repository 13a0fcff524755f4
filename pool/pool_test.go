package pool_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rblk/rblk/pool"
)

func open(t *testing.T, cfg pool.Config) *pool.Pool {
	t.Helper()
	if cfg.Name == "" {
		cfg.Name = "p"
	}
	if cfg.Dir == "" {
		cfg.Dir = filepath.Join(t.TempDir(), "pool")
	}
	p, err := pool.Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func TestCheckName(t *testing.T) {
	for _, c := range []struct {
		name string
		ok   bool
	}{
		{"pvc-0b7c1f0e-2a7d-4c57-9d0b-3f1f3b8f6a21", true},
		{"a", true},
		{"vol_1.data", true},
		{"", false},
		{"../etc", false},
		{"a/b", false},
		{"a..b", false},
		{".hidden", false},
		{"-flag", false},
		{"a:b", false},
		{"a b", false},
		{"a\x00b", false},
		{strings.Repeat("a", pool.MaxNameLen), true},
		{strings.Repeat("a", pool.MaxNameLen+1), false},
	} {
		err := pool.CheckName(c.name)
		if (err == nil) != c.ok {
			t.Errorf("CheckName(%q) = %v, want ok %v", c.name, err, c.ok)
		}
		if err != nil && !errors.Is(err, pool.ErrInvalid) {
			t.Errorf("CheckName(%q) = %v, want ErrInvalid", c.name, err)
		}
	}
}

// TestCreateIdempotent: a retried create returns the volume; another
// size is ErrExists; a bad name or size creates nothing.
func TestCreateIdempotent(t *testing.T) {
	p := open(t, pool.Config{})
	v, created, err := p.Create("vol-1", 1<<20, false)
	if err != nil || !created {
		t.Fatalf("create: %v, created %v", err, created)
	}
	if v.Size != 1<<20 || v.Export() != "p:vol-1" || len(v.Hosts) != 0 {
		t.Fatalf("created %+v", v)
	}
	again, created, err := p.Create("vol-1", 1<<20, false)
	if err != nil || created || again.Ino != v.Ino {
		t.Fatalf("create again: %+v, created %v, %v; want the same volume, not created", again, created, err)
	}
	if _, _, err := p.Create("vol-1", 2<<20, false); !errors.Is(err, pool.ErrExists) {
		t.Fatalf("create with another size: %v, want ErrExists", err)
	}
	if _, _, err := p.Create("vol-1", 1<<20, true); !errors.Is(err, pool.ErrExists) {
		t.Fatalf("create with another sharing: %v, want ErrExists", err)
	}
	for _, bad := range []struct {
		name string
		size int64
	}{{"../x", 1 << 20}, {"a/b", 1 << 20}, {"ok", 0}, {"ok", 1000}, {"ok", -4096}} {
		if _, _, err := p.Create(bad.name, bad.size, false); !errors.Is(err, pool.ErrInvalid) {
			t.Errorf("create %q of %d bytes: %v, want ErrInvalid", bad.name, bad.size, err)
		}
	}
	vols, err := p.List()
	if err != nil || len(vols) != 1 {
		t.Fatalf("list: %v, %v; want one volume", vols, err)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(v.Path), "..", "x.img")); err == nil {
		t.Fatal("a create with \"..\" wrote outside the pool")
	}
}

// TestCapacity: the limit bounds what is provisioned, sparse or not.
func TestCapacity(t *testing.T) {
	p := open(t, pool.Config{Capacity: 8 << 20})
	c, err := p.Capacity()
	if err != nil || c.Limit != 8<<20 || c.Available != 8<<20 || c.Provisioned != 0 {
		t.Fatalf("empty pool: %+v, %v", c, err)
	}
	if _, _, err := p.Create("a", 6<<20, false); err != nil {
		t.Fatal(err)
	}
	c, _ = p.Capacity()
	if c.Provisioned != 6<<20 || c.Available != 2<<20 || c.Volumes != 1 {
		t.Fatalf("after a 6M volume: %+v", c)
	}
	if _, _, err := p.Create("b", 3<<20, false); !errors.Is(err, pool.ErrNoSpace) {
		t.Fatalf("create past the capacity: %v, want ErrNoSpace", err)
	}
	if err := p.CheckGrow("a", 9<<20); !errors.Is(err, pool.ErrNoSpace) {
		t.Fatalf("grow past the capacity: %v, want ErrNoSpace", err)
	}
	if err := p.CheckGrow("a", 8<<20); err != nil {
		t.Fatalf("grow within the capacity: %v", err)
	}
	if err := p.CheckGrow("a", 4<<20); !errors.Is(err, pool.ErrInvalid) {
		t.Fatalf("shrink: %v, want ErrInvalid", err)
	}
	if err := p.CheckGrow("nope", 4<<20); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("grow of an unknown volume: %v, want ErrNotFound", err)
	}
	if err := p.Delete("a"); err != nil {
		t.Fatal(err)
	}
	if c, _ := p.Capacity(); c.Available != 8<<20 {
		t.Fatalf("after the delete: %+v, want all available", c)
	}
}

// TestMaxVolumes: a pool holds at most MaxVolumes.
func TestMaxVolumes(t *testing.T) {
	p := open(t, pool.Config{MaxVolumes: 2})
	for _, n := range []string{"a", "b"} {
		if _, _, err := p.Create(n, 4096, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := p.Create("c", 4096, false); !errors.Is(err, pool.ErrNoSpace) {
		t.Fatalf("a third volume: %v, want ErrNoSpace", err)
	}
	if _, _, err := p.Create("a", 4096, false); err != nil {
		t.Fatalf("a retried create at the limit: %v", err)
	}
}

// TestReopen: volumes, their hosts and sizes survive a restart; a second
// process cannot hold the pool.
func TestReopen(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	p, err := pool.Open(pool.Config{Name: "p", Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Open(pool.Config{Name: "p", Dir: dir}); !errors.Is(err, pool.ErrInUse) {
		t.Fatalf("second open: %v, want ErrInUse", err)
	}
	v, _, err := p.Create("a", 1<<20, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.SetHosts("a", []string{"node-b", "node-a", "node-b"}); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(v.Path, 2<<20); err != nil { // grown (as the target's Grow does)
		t.Fatal(err)
	}
	p.Close()
	p.Close() // twice is fine
	p = open(t, pool.Config{Dir: dir})
	got, err := p.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	if got.Size != 2<<20 || !got.Shared || strings.Join(got.Hosts, ",") != "node-a,node-b" || got.Ino != v.Ino {
		t.Fatalf("after reopen: %+v", got)
	}
}

// TestCrashLeftovers: what a crash leaves (a data file without a record,
// a record being written) is removed at Open, and a create of that name
// starts from zeros.
func TestCrashLeftovers(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	secret := bytes.Repeat([]byte("old data "), 1000)
	if err := os.WriteFile(filepath.Join(dir, "a.img"), secret, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ".a.meta.tmp"), []byte(`{"version":1,`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("an operator's"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := open(t, pool.Config{Dir: dir})
	for _, gone := range []string{"a.img", ".a.meta.tmp"} {
		if _, err := os.Stat(filepath.Join(dir, gone)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after Open: %v, want it removed", gone, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "notes.txt")); err != nil {
		t.Errorf("a file not the pool's was touched: %v", err)
	}
	if vols, _ := p.List(); len(vols) != 0 {
		t.Fatalf("volumes after Open: %+v, want none", vols)
	}
	// A data file left by a create cut short, then created again: zeros.
	if err := os.WriteFile(filepath.Join(dir, "b.img"), secret, 0o600); err != nil {
		t.Fatal(err)
	}
	v, _, err := p.Create("b", 64<<10, false)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(v.Path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, make([]byte, 64<<10)) {
		t.Fatal("a new volume shows the bytes of a file left behind")
	}
}

// TestDamaged: a data file replaced behind the pool's back, or a record
// that does not parse, is not served, and its name is not taken over.
func TestDamaged(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	p, err := pool.Open(pool.Config{Name: "p", Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"swapped", "garbled", "fine"} {
		if _, _, err := p.Create(n, 4096, false); err != nil {
			t.Fatal(err)
		}
	}
	p.Close()
	// Another file renamed over it: another inode (made while the old
	// one lives, so not the old one's number reused).
	other := filepath.Join(dir, "other")
	if err := os.WriteFile(other, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other, filepath.Join(dir, "swapped.img")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "garbled.meta"), []byte("{half"), 0o600); err != nil {
		t.Fatal(err)
	}
	p = open(t, pool.Config{Dir: dir})
	d := p.Damaged()
	if len(d) != 2 || d["swapped"] == nil || d["garbled"] == nil {
		t.Fatalf("damaged: %v, want swapped and garbled", d)
	}
	for n := range d {
		if _, err := p.Get(n); !errors.Is(err, pool.ErrDamaged) {
			t.Errorf("get %s: %v, want ErrDamaged", n, err)
		}
		if _, _, err := p.Create(n, 4096, false); !errors.Is(err, pool.ErrDamaged) {
			t.Errorf("create %s over a damaged volume: %v, want ErrDamaged", n, err)
		}
	}
	if vols, _ := p.List(); len(vols) != 1 || vols[0].Name != "fine" {
		t.Fatalf("list: %+v, want only fine", vols)
	}
}

// TestDelete removes both files; a delete of an unknown volume is
// ErrNotFound.
func TestDelete(t *testing.T) {
	p := open(t, pool.Config{})
	v, _, err := p.Create("a", 4096, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Delete("a"); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(filepath.Dir(v.Path))
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "a.") {
			t.Errorf("%s left after delete", e.Name())
		}
	}
	if err := p.Delete("a"); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("delete again: %v, want ErrNotFound", err)
	}
	if err := p.Delete("../a"); !errors.Is(err, pool.ErrInvalid) {
		t.Fatalf("delete of a bad name: %v, want ErrInvalid", err)
	}
}
