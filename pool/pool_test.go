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
	if _, err := p.ReserveGrow("a", 9<<20); !errors.Is(err, pool.ErrNoSpace) {
		t.Fatalf("grow past the capacity: %v, want ErrNoSpace", err)
	}
	release, err := p.ReserveGrow("a", 8<<20)
	if err != nil {
		t.Fatalf("grow within the capacity: %v", err)
	}
	// The room is taken until the growth is made and released.
	if _, _, err := p.Create("b", 1<<20, false); !errors.Is(err, pool.ErrNoSpace) {
		t.Fatalf("create while a growth holds the room: %v, want ErrNoSpace", err)
	}
	if _, err := p.ReserveGrow("a", 8<<20); !errors.Is(err, pool.ErrNoSpace) {
		t.Fatalf("a second growth into the same room: %v, want ErrNoSpace", err)
	}
	release()
	release() // twice is fine
	if c, _ := p.Capacity(); c.Available != 2<<20 {
		t.Fatalf("after the release (the file never grew): %+v, want 2M available", c)
	}
	if _, err := p.ReserveGrow("a", 4<<20); !errors.Is(err, pool.ErrInvalid) {
		t.Fatalf("shrink: %v, want ErrInvalid", err)
	}
	if _, err := p.ReserveGrow("nope", 4<<20); !errors.Is(err, pool.ErrNotFound) {
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

// TestCrash kills a create and a delete at each of their steps (the
// hook stops them there, as kill -9 would) and opens the pool again: each
// volume is whole or absent, what never committed is gone, what committed
// is finished.
func TestCrash(t *testing.T) {
	for _, c := range []struct {
		point  string
		exists bool // the volume, after the reopen
	}{
		{"create: data file made", false},
		{"create: record written", true},
		{"delete: data file renamed", false},
		{"delete: record removed", false},
	} {
		t.Run(c.point, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pool")
			p, err := pool.Open(pool.Config{Name: "p", Dir: dir})
			if err != nil {
				t.Fatal(err)
			}
			if strings.HasPrefix(c.point, "delete") {
				if _, _, err := p.Create("v", 64<<10, false); err != nil {
					t.Fatal(err)
				}
			}
			pool.SetTestCrash(func(point string) bool { return point == c.point })
			if strings.HasPrefix(c.point, "create") {
				_, _, err = p.Create("v", 64<<10, false)
			} else {
				err = p.Delete("v")
			}
			pool.SetTestCrash(nil)
			if err == nil {
				t.Fatalf("the hook at %q did not fire", c.point)
			}
			p.Close()
			p = open(t, pool.Config{Dir: dir})
			if d := p.Damaged(); len(d) != 0 {
				t.Fatalf("damaged after the crash: %v", d)
			}
			v, err := p.Get("v")
			if c.exists != (err == nil) {
				t.Fatalf("the volume after the crash: %+v, %v; want it there: %v", v, err, c.exists)
			}
			entries, _ := os.ReadDir(dir)
			var names []string
			for _, e := range entries {
				if e.Name() != ".rblk-pool.lock" {
					names = append(names, e.Name())
				}
			}
			want := []string(nil)
			if c.exists {
				want = []string{"v.img", "v.meta"}
				if v.Size != 64<<10 {
					t.Fatalf("size %d after the crash", v.Size)
				}
			}
			if strings.Join(names, " ") != strings.Join(want, " ") {
				t.Fatalf("files after the crash: %q, want %q", names, want)
			}
			// And the name works again.
			if !c.exists {
				if _, _, err := p.Create("v", 64<<10, false); err != nil {
					t.Fatalf("create after the crash: %v", err)
				}
			}
		})
	}
}

// TestStrangers: files a crash left (a record being written) go; a data
// file without a record is not the pool's: left alone, untouched, and its
// name is not created over it.
func TestStrangers(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pool")
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	precious := bytes.Repeat([]byte("an operator's data "), 1000)
	if err := os.WriteFile(filepath.Join(dir, "a.img"), precious, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ".a.meta.tmp"), []byte(`{"version":1,`), 0o600); err != nil {
		t.Fatal(err)
	}
	p := open(t, pool.Config{Dir: dir})
	if _, err := os.Stat(filepath.Join(dir, ".a.meta.tmp")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a half-written record after Open: %v, want it removed", err)
	}
	if vols, _ := p.List(); len(vols) != 0 {
		t.Fatalf("volumes after Open: %+v, want none", vols)
	}
	if _, _, err := p.Create("a", 64<<10, false); !errors.Is(err, pool.ErrExists) {
		t.Fatalf("create over a file not the pool's: %v, want ErrExists", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "a.img")); err != nil || !bytes.Equal(b, precious) {
		t.Fatalf("a file not the pool's was touched: %v", err)
	}
	// A new volume reads zeros.
	v, _, err := p.Create("b", 64<<10, false)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(v.Path); !bytes.Equal(b, make([]byte, 64<<10)) {
		t.Fatal("a new volume is not zeros")
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
