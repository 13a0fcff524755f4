package mirror

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.uber.org/zap/zaptest"
)

// fakeMD plays mdadm over a fake /dev and /sys/block: --create and
// --assemble make md0 with its members in sync; --fail, --remove,
// --re-add and --add change their states; --examine answers from sbs.
type fakeMD struct {
	t      *testing.T
	root   string
	calls  []string
	sbs    map[string]string // member -> "UUID NAME"; absent: no superblock
	reAdd  error             // what --re-add answers
	member map[string]string // member -> state, while assembled
}

func newFakeMD(t *testing.T) (*fakeMD, Options) {
	f := &fakeMD{t: t, root: t.TempDir(), sbs: map[string]string{}, member: map[string]string{}}
	o := Options{Name: "vol1", Run: f.run, Logger: zaptest.NewLogger(t),
		sysBlock: filepath.Join(f.root, "sys", "block"), devDir: filepath.Join(f.root, "dev")}
	for _, d := range []string{o.sysBlock, filepath.Join(o.devDir, "md")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return f, o
}

func (f *fakeMD) dev(name string) string { return filepath.Join(f.root, "dev", name) }

// sync writes the fake sysfs of md0 from f.member.
func (f *fakeMD) sync() {
	md := filepath.Join(f.root, "sys", "block", "md0", "md")
	os.RemoveAll(md)
	degraded := 2
	for m, st := range f.member {
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
	os.WriteFile(f.dev("md0"), nil, 0o644) // (the device node)
	os.Symlink(f.dev("md0"), filepath.Join(f.root, "dev", "md", "vol1"))
}

func (f *fakeMD) run(_ context.Context, name string, args ...string) ([]byte, error) {
	f.calls = append(f.calls, name+" "+strings.Join(args, " "))
	switch {
	case args[0] == "--examine":
		sb, ok := f.sbs[args[2]]
		if !ok {
			return nil, fmt.Errorf("mdadm --examine: exit status 1: mdadm: No md superblock detected on %s.", args[2])
		}
		uuid, n, _ := strings.Cut(sb, " ")
		return []byte("MD_LEVEL=raid1\nMD_UUID=" + uuid + "\nMD_NAME=" + n + "\n"), nil
	case args[0] == "--create" || args[0] == "--assemble":
		for _, a := range args {
			if strings.HasPrefix(a, f.dev("nbd")) {
				f.member[a] = "in_sync"
				f.sbs[a] = "u-1 host:vol1"
			}
		}
		f.sync()
	case args[0] == "--zero-superblock":
		delete(f.sbs, args[1])
	case len(args) == 3 && args[1] == "--fail":
		if _, ok := f.member[args[2]]; ok {
			f.member[args[2]] = "faulty"
		}
		f.sync()
	case len(args) == 3 && args[1] == "--remove":
		for m, st := range f.member {
			if st == "faulty" && args[2] == "failed" {
				delete(f.member, m)
			}
		}
		f.sync()
	case len(args) == 3 && args[1] == "--re-add":
		if f.reAdd != nil {
			return nil, f.reAdd
		}
		f.member[args[2]] = "in_sync"
		f.sync()
	case len(args) == 3 && args[1] == "--add":
		f.member[args[2]] = "in_sync"
		f.sbs[args[2]] = "u-1 host:vol1"
		f.sync()
	case args[0] == "--grow":
		os.WriteFile(filepath.Join(f.root, "sys", "block", "md0", "size"), []byte("262144\n"), 0o644)
	case args[0] == "--stop":
		f.member = map[string]string{}
		os.RemoveAll(filepath.Join(f.root, "sys", "block", "md0"))
		os.Remove(filepath.Join(f.root, "dev", "md", "vol1"))
		os.Remove(f.dev("md0"))
	}
	return nil, nil
}

// Grow grows the array to what its members allow and says its size.
func TestGrow(t *testing.T) {
	ctx := context.Background()
	f, o := newFakeMD(t)
	if _, err := Grow(ctx, o); !errors.Is(err, ErrNotUp) {
		t.Fatalf("Grow of an array not up: %v", err)
	}
	o.Members = []string{f.dev("nbd0"), f.dev("nbd1")}
	if _, err := Up(ctx, o); err != nil {
		t.Fatal(err)
	}
	n, err := Grow(ctx, o)
	if err != nil || n != 128<<20 || !f.called("--grow "+o.Path()+" --size=max") {
		t.Fatalf("Grow: %d, %v, calls %q", n, err, f.calls)
	}
}

// called reports whether a call started with prefix (after "mdadm ").
func (f *fakeMD) called(prefix string) bool {
	return slices.ContainsFunc(f.calls, func(c string) bool { return strings.HasPrefix(c, "mdadm "+prefix) })
}

// Path is /dev/md/NAME, also on Options whose defaults were not applied
// (the caller's copy).
func TestPath(t *testing.T) {
	if p := (&Options{Name: "vol1"}).Path(); p != "/dev/md/vol1" {
		t.Errorf("Path() = %q", p)
	}
}

func TestCheckName(t *testing.T) {
	for _, ok := range []string{"a", "pvc-1.b_2", strings.Repeat("x", 32)} {
		if err := CheckName(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-a", ".a", "a/b", "a b", strings.Repeat("x", 33), "../x"} {
		if err := CheckName(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// Up creates an array over blank members (in sync when fresh, with an
// internal bitmap), assembles one whose members carry its superblock
// (adding a blank one in full), returns an assembled one as it is, and
// refuses a member of another array without a call that writes.
func TestUp(t *testing.T) {
	ctx := context.Background()
	f, o := newFakeMD(t)
	o.Members, o.Fresh = []string{f.dev("nbd0"), f.dev("nbd1")}, true
	dev, err := Up(ctx, o)
	if err != nil || dev != f.dev("md0") {
		t.Fatalf("Up: %q, %v", dev, err)
	}
	create := f.calls[len(f.calls)-1]
	for _, want := range []string{"--create " + o.Path(), "--level=1", "--raid-devices=2", "--bitmap=internal", "--name=vol1", "--assume-clean", "--data-offset=4096K", f.dev("nbd0") + " " + f.dev("nbd1")} {
		if !strings.Contains(create, want) {
			t.Errorf("%q lacks %q", create, want)
		}
	}
	n := len(f.calls)
	if dev, err := Up(ctx, o); err != nil || dev != f.dev("md0") || len(f.calls) != n {
		t.Fatalf("Up of an array up: %q, %v, calls %q", dev, err, f.calls[n:])
	}
	if err := Down(ctx, o); err != nil || !f.called("--stop") {
		t.Fatalf("Down: %v, calls %q", err, f.calls)
	}

	// Assembled again, the second member replaced by a blank one.
	delete(f.sbs, f.dev("nbd1"))
	o.Members = []string{f.dev("nbd0"), f.dev("nbd2")}
	f.calls = nil
	if _, err := Up(ctx, o); err != nil {
		t.Fatal(err)
	}
	if !f.called("--assemble "+o.Path()+" --run "+f.dev("nbd0")) || !f.called("--zero-superblock "+f.dev("nbd2")) || !f.called(o.Path()+" --add "+f.dev("nbd2")) || f.called("--create") {
		t.Errorf("assembling with a blank member: %q", f.calls)
	}
	Down(ctx, o)

	// Another array's member.
	f.sbs[f.dev("nbd3")] = "u-2 host:other"
	o.Members = []string{f.dev("nbd0"), f.dev("nbd3")}
	f.calls = nil
	if _, err := Up(ctx, o); !errors.Is(err, ErrForeign) {
		t.Fatalf("Up with another array's member: %v", err)
	}
	for _, c := range f.calls {
		if !strings.HasPrefix(c, "mdadm --examine") {
			t.Errorf("Up with another array's member ran %q", c)
		}
	}
}

// fakeLeg is a member's attach.
type fakeLeg struct {
	dev       string
	serving   bool
	reattach  string
	reattachN int
}

func (l *fakeLeg) Device() (string, bool) { return l.dev, l.serving }
func (l *fakeLeg) Reattach(context.Context) (string, error) {
	l.reattachN++
	l.dev, l.serving = l.reattach, true
	return l.dev, nil
}

// Check re-adds a failed member from the bitmap once its attach serves
// again (not while it waits for its target), adds it in full when
// md refuses that, and attaches a member whose attach ended again and
// adds it in full, removing its failed earlier device first.
func TestCheck(t *testing.T) {
	ctx := context.Background()
	f, o := newFakeMD(t)
	o.Members = []string{f.dev("nbd0"), f.dev("nbd1")}
	if _, err := Up(ctx, o); err != nil {
		t.Fatal(err)
	}
	legs := []*fakeLeg{{dev: f.dev("nbd0"), serving: true}, {dev: f.dev("nbd1"), serving: false}}
	ll := []Leg{legs[0], legs[1]}
	full := make([]bool, 2)

	// md failed member 1 while its target was away.
	f.member[f.dev("nbd1")] = "faulty"
	f.sync()
	f.calls = nil
	Check(ctx, o, ll, full)
	if len(f.calls) != 0 {
		t.Fatalf("Check while the member's attach waits for its target: %q", f.calls)
	}
	legs[1].serving = true
	Check(ctx, o, ll, full)
	if !f.called(o.Path()+" --re-add "+f.dev("nbd1")) || f.called("--zero-superblock") {
		t.Fatalf("Check once the member serves again: %q, want a re-add from the bitmap", f.calls)
	}
	st, err := Stat(o)
	if err != nil || !st.Healthy() {
		t.Fatalf("after the re-add: %+v, %v", st, err)
	}

	// The bitmap refused: in full.
	f.member[f.dev("nbd1")] = "faulty"
	f.sync()
	f.reAdd = errors.New("mdadm: --re-add for /dev/nbd1 to /dev/md/vol1 is not possible")
	f.calls = nil
	Check(ctx, o, ll, full)
	if !f.called("--zero-superblock "+f.dev("nbd1")) || !f.called(o.Path()+" --add "+f.dev("nbd1")) {
		t.Fatalf("Check when the re-add is refused: %q, want a full add", f.calls)
	}
	f.reAdd = nil

	// Member 1's attach ended (it lost writes): attached again as nbd5,
	// added in full, its old device out.
	f.member[f.dev("nbd1")] = "faulty"
	f.sync()
	legs[1].dev, legs[1].reattach = "", f.dev("nbd5")
	f.calls = nil
	Check(ctx, o, ll, full)
	if legs[1].reattachN != 1 || !f.called(o.Path()+" --remove failed") || !f.called("--zero-superblock "+f.dev("nbd5")) ||
		!f.called(o.Path()+" --add "+f.dev("nbd5")) || f.called(o.Path()+" --re-add") {
		t.Fatalf("Check after the member's attach ended: %d reattaches, calls %q", legs[1].reattachN, f.calls)
	}
	if st, err := Stat(o); err != nil || !st.Healthy() || len(st.Members) != 2 {
		t.Fatalf("after the full add: %+v, %v", st, err)
	}
	f.calls = nil
	Check(ctx, o, ll, full)
	if len(f.calls) != 0 {
		t.Fatalf("Check of a whole array: %q", f.calls)
	}
}
