package mirror

import (
	"context"
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/rblk/rblk/mirror/mirrortest"
)

func newFakeMD(t *testing.T) (*mirrortest.FakeMD, Options) {
	f := mirrortest.New(t)
	return f, Options{Name: "vol1", Run: f.Run, Logger: zaptest.NewLogger(t), SysBlock: f.SysBlock(), DevDir: f.DevDir()}
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
	o.Members, o.Fresh = []string{f.Dev("nbd0"), f.Dev("nbd1")}, true
	dev, err := Up(ctx, o)
	if err != nil || dev != f.Dev("md0") {
		t.Fatalf("Up: %q, %v", dev, err)
	}
	create := f.Calls()[len(f.Calls())-1]
	for _, want := range []string{"--create " + o.Path(), "--level=1", "--raid-devices=2", "--bitmap=internal", "--name=vol1", "--assume-clean", "--data-offset=4096K", f.Dev("nbd0") + " " + f.Dev("nbd1")} {
		if !strings.Contains(create, want) {
			t.Errorf("%q lacks %q", create, want)
		}
	}
	n := len(f.Calls())
	if dev, err := Up(ctx, o); err != nil || dev != f.Dev("md0") || len(f.Calls()) != n {
		t.Fatalf("Up of an array up: %q, %v, calls %q", dev, err, f.Calls()[n:])
	}
	if err := Down(ctx, o); err != nil || !f.Called("--stop") {
		t.Fatalf("Down: %v, calls %q", err, f.Calls())
	}

	// Assembled again, the second member replaced by a blank one.
	delete(f.SBs, f.Dev("nbd1"))
	o.Members = []string{f.Dev("nbd0"), f.Dev("nbd2")}
	f.ResetCalls()
	if _, err := Up(ctx, o); err != nil {
		t.Fatal(err)
	}
	if !f.Called("--assemble "+o.Path()+" --run "+f.Dev("nbd0")) || !f.Called("--zero-superblock "+f.Dev("nbd2")) || !f.Called(o.Path()+" --add "+f.Dev("nbd2")) || f.Called("--create") {
		t.Errorf("assembling with a blank member: %q", f.Calls())
	}
	Down(ctx, o)

	// Another array's member.
	f.SBs[f.Dev("nbd3")] = "u-2 host:other"
	o.Members = []string{f.Dev("nbd0"), f.Dev("nbd3")}
	f.ResetCalls()
	if _, err := Up(ctx, o); !errors.Is(err, ErrForeign) {
		t.Fatalf("Up with another array's member: %v", err)
	}
	for _, c := range f.Calls() {
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
	o.Members = []string{f.Dev("nbd0"), f.Dev("nbd1")}
	if _, err := Up(ctx, o); err != nil {
		t.Fatal(err)
	}
	legs := []*fakeLeg{{dev: f.Dev("nbd0"), serving: true}, {dev: f.Dev("nbd1"), serving: false}}
	ll := []Leg{legs[0], legs[1]}
	full := make([]bool, 2)

	// md failed member 1 while its target was away.
	f.Member[f.Dev("nbd1")] = "faulty"
	f.Sync()
	f.ResetCalls()
	Check(ctx, o, ll, full)
	if len(f.Calls()) != 0 {
		t.Fatalf("Check while the member's attach waits for its target: %q", f.Calls())
	}
	legs[1].serving = true
	Check(ctx, o, ll, full)
	if !f.Called(o.Path()+" --re-add "+f.Dev("nbd1")) || f.Called("--zero-superblock") {
		t.Fatalf("Check once the member serves again: %q, want a re-add from the bitmap", f.Calls())
	}
	st, err := Stat(o)
	if err != nil || !st.Healthy() {
		t.Fatalf("after the re-add: %+v, %v", st, err)
	}

	// The bitmap refused: in full.
	f.Member[f.Dev("nbd1")] = "faulty"
	f.Sync()
	f.ReAdd = errors.New("mdadm: --re-add for /dev/nbd1 to /dev/md/vol1 is not possible")
	f.ResetCalls()
	Check(ctx, o, ll, full)
	if !f.Called("--zero-superblock "+f.Dev("nbd1")) || !f.Called(o.Path()+" --add "+f.Dev("nbd1")) {
		t.Fatalf("Check when the re-add is refused: %q, want a full add", f.Calls())
	}
	f.ReAdd = nil

	// Member 1's attach ended (it lost writes): attached again as nbd5,
	// added in full, its old device out.
	f.Member[f.Dev("nbd1")] = "faulty"
	f.Sync()
	legs[1].dev, legs[1].reattach = "", f.Dev("nbd5")
	f.ResetCalls()
	Check(ctx, o, ll, full)
	if legs[1].reattachN != 1 || !f.Called(o.Path()+" --remove failed") || !f.Called("--zero-superblock "+f.Dev("nbd5")) ||
		!f.Called(o.Path()+" --add "+f.Dev("nbd5")) || f.Called(o.Path()+" --re-add") {
		t.Fatalf("Check after the member's attach ended: %d reattaches, calls %q", legs[1].reattachN, f.Calls())
	}
	if st, err := Stat(o); err != nil || !st.Healthy() || len(st.Members) != 2 {
		t.Fatalf("after the full add: %+v, %v", st, err)
	}
	f.ResetCalls()
	Check(ctx, o, ll, full)
	if len(f.Calls()) != 0 {
		t.Fatalf("Check of a whole array: %q", f.Calls())
	}
}
