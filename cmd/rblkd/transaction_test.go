package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rblk/rblk/admin"
	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/transporttest"
)

// reloadLocked reloads as SIGHUP does, with the daemon's lock.
func reloadLocked(ctx context.Context, d *daemon) (string, error) {
	if err := d.lock(ctx); err != nil {
		return "", err
	}
	defer d.unlock()
	return d.reload(ctx)
}

func st(name, path string, size uint64, file uint64) target.ExportStatus {
	return target.ExportStatus{Config: target.ExportConfig{Name: name, Path: path}, Size: size, File: target.FileID{Dev: 1, Ino: file}}
}

// TestPlanReload: the steps from the running exports to the wanted ones,
// by name, without IO.
func TestPlanReload(t *testing.T) {
	cur := []target.ExportStatus{st("a", "/a", 1<<20, 1), st("b", "/b", 1<<20, 2), st("c", "/c", 2<<20, 3)}
	cur[2].Config.Size = 1 << 20 // c grew online past its configured size
	for _, c := range []struct {
		name string
		want []target.ExportConfig
		plan plan
		err  error
	}{
		{"nothing changes", []target.ExportConfig{{Name: "a", Path: "/a"}, {Name: "b", Path: "/b"}, {Name: "c", Path: "/c", Size: 1 << 20}}, plan{}, nil},
		{"all removed", nil, plan{remove: []string{"a", "b", "c"}}, nil},
		{"add, remove, update, replace", []target.ExportConfig{{Name: "d", Path: "/d", Size: 4096}, {Name: "b", Path: "/b2"},
			{Name: "a", Path: "/a", Shared: true}, {Name: "c", Path: "/c", Size: 1 << 20, ReadOnly: true}},
			plan{open: []change{{cfg: target.ExportConfig{Name: "d", Path: "/d", Size: 4096}}, {cfg: target.ExportConfig{Name: "b", Path: "/b2"}, replace: true},
				{cfg: target.ExportConfig{Name: "c", Path: "/c", Size: 1 << 20, ReadOnly: true}, replace: true}},
				update: []target.ExportConfig{{Name: "a", Path: "/a", Shared: true}}}, nil},
		{"allow changed", []target.ExportConfig{{Name: "a", Path: "/a", Allow: []string{"h"}}, {Name: "b", Path: "/b"}, {Name: "c", Path: "/c", Size: 1 << 20}},
			plan{update: []target.ExportConfig{{Name: "a", Path: "/a", Allow: []string{"h"}}}}, nil},
		{"grow", []target.ExportConfig{{Name: "a", Path: "/a", Size: 2 << 20}, {Name: "b", Path: "/b"}, {Name: "c", Path: "/c", Size: 1 << 20}},
			plan{update: []target.ExportConfig{{Name: "a", Path: "/a", Size: 2 << 20}}}, nil},
		{"shrink", []target.ExportConfig{{Name: "a", Path: "/a", Size: 4096}}, plan{}, target.ErrShrink},
		// c's configured size is unchanged: not compared with the volume
		// that grew.
		{"size below a grown volume, unchanged", []target.ExportConfig{{Name: "c", Path: "/c", Size: 1 << 20}}, plan{remove: []string{"a", "b"}}, nil},
		// c's size set to what it grew to: an update, not a shrink.
		{"size set to the grown volume's", []target.ExportConfig{{Name: "c", Path: "/c", Size: 2 << 20}},
			plan{remove: []string{"a", "b"}, update: []target.ExportConfig{{Name: "c", Path: "/c", Size: 2 << 20}}}, nil},
	} {
		p, err := planReload(cur, c.want)
		if !errors.Is(err, c.err) {
			t.Errorf("%s: error %v, want %v", c.name, err, c.err)
			continue
		}
		if err == nil && !reflect.DeepEqual(p, c.plan) {
			t.Errorf("%s: plan\n%+v, want\n%+v", c.name, p, c.plan)
		}
	}
}

// TestSchedule: one file is one export; a file that moves from an export
// to another waits for the first's removal; a replace waits for its own;
// another name of the same file is an update; the order is adds, removes,
// the adds that waited, updates.
func TestSchedule(t *testing.T) {
	cur := []target.ExportStatus{st("a", "/a", 1<<20, 1), st("b", "/b", 1<<20, 2), st("c", "/c", 1<<20, 3)}
	add := func(name, path string) change { return change{cfg: target.ExportConfig{Name: name, Path: path}} }
	repl := func(name, path string) change {
		return change{cfg: target.ExportConfig{Name: name, Path: path}, replace: true}
	}
	type step struct {
		kind  opKind
		name  string
		after string
	}
	for _, c := range []struct {
		name  string
		plan  plan
		files map[string]uint64 // inode of each opened file
		want  []step
		err   string
	}{
		{"new file", plan{open: []change{add("d", "/d")}, remove: []string{"c"}, update: []target.ExportConfig{{Name: "a"}}},
			map[string]uint64{"d": 4}, []step{{opAdd, "d", ""}, {opRemove, "c", ""}, {opUpdate, "a", ""}}, ""},
		{"second name of a kept export's file", plan{open: []change{add("d", "/x/../a")}}, map[string]uint64{"d": 1}, nil,
			`export "d": /x/../a is the same file as export "a" (/a)`},
		{"two new exports of one file", plan{open: []change{add("d", "/d"), add("e", "/e")}}, map[string]uint64{"d": 4, "e": 4}, nil,
			`export "e": /e is the same file as export "d" (/d)`},
		{"a replace onto a kept export's file", plan{open: []change{repl("c", "/b")}}, map[string]uint64{"c": 2}, nil,
			`export "c": /b is the same file as export "b" (/b)`},
		{"rename: the file moves from a to d", plan{open: []change{add("d", "/a")}, remove: []string{"a"}},
			map[string]uint64{"d": 1}, []step{{opRemove, "a", ""}, {opAdd, "d", "a"}}, ""},
		{"replace by another file", plan{open: []change{repl("a", "/a2"), add("d", "/d")}},
			map[string]uint64{"a": 9, "d": 4}, []step{{opAdd, "d", ""}, {opRemove, "a", ""}, {opAdd, "a", "a"}}, ""},
		{"another name of the same file", plan{open: []change{repl("a", "/l/a")}}, map[string]uint64{"a": 1}, []step{{opUpdate, "a", ""}}, ""},
		{"swap: a and b trade files", plan{open: []change{repl("a", "/b"), repl("b", "/a")}},
			map[string]uint64{"a": 2, "b": 1}, []step{{opRemove, "a", ""}, {opRemove, "b", ""}, {opAdd, "a", "a,b"}, {opAdd, "b", "b,a"}}, ""},
	} {
		files := map[string]target.FileID{}
		for n, ino := range c.files {
			files[n] = target.FileID{Dev: 1, Ino: ino}
		}
		ops, err := schedule(cur, c.plan, files)
		if c.err != "" {
			if err == nil || err.Error() != c.err || !errors.Is(err, target.ErrSameFile) {
				t.Errorf("%s: %v, want %q", c.name, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		var got []step
		for _, o := range ops {
			got = append(got, step{o.kind, o.name, strings.Join(o.after, ",")})
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: steps %+v, want %+v", c.name, got, c.want)
		}
	}
}

// failSync is a backing store whose Sync fails while fail is set.
type failSync struct {
	*os.File
	fail *atomic.Bool
}

func (f failSync) Sync() error {
	if f.fail.Load() {
		return syscall.EIO
	}
	return f.File.Sync()
}

// txEnv is a target with a daemon over a configuration file.
type txEnv struct {
	t    *testing.T
	dir  string
	cfg  string
	tg   *target.Target
	d    *daemon
	logs *observer.ObservedLogs
	// failSync makes the Sync of the export "stuck" fail.
	failSync atomic.Bool
}

func (e *txEnv) img(n string) string { return filepath.Join(e.dir, n+".img") }

func (e *txEnv) write(s string) {
	e.t.Helper()
	if err := os.WriteFile(e.cfg, []byte(s), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

// startTx starts a target with the exports of the file content and a
// daemon reloading it.
func startTx(t *testing.T, content func(e *txEnv) string) *txEnv {
	t.Helper()
	transporttest.CheckGoroutines(t)
	e := &txEnv{t: t, dir: t.TempDir()}
	e.cfg = filepath.Join(e.dir, "rblkd.yaml")
	e.write(content(e))
	cmd := newServeCmd()
	if err := cmd.ParseFlags([]string{"--config", e.cfg}); err != nil {
		t.Fatal(err)
	}
	f := serveFlags{config: e.cfg}
	if err := loadConfig(cmd, &f); err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	e.logs = logs
	tg, err := target.New(target.Options{Exports: f.file.fileExports, CacheSize: 4 << 20, ChunkSize: 64 << 10, Logger: zap.New(core),
		WrapStore: func(name string, f *os.File) target.Store {
			if name == "stuck" {
				return failSync{File: f, fail: &e.failSync}
			}
			return f
		}})
	if err != nil {
		t.Fatal(err)
	}
	e.tg = tg
	t.Cleanup(func() { tg.Close() })
	if e.d, err = startDaemon(context.Background(), tg, nil, f, nil, nil, zap.New(core)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.d.stop)
	return e
}

// exports is the running exports: name -> path.
func (e *txEnv) exports() map[string]string {
	m := map[string]string{}
	for _, s := range e.tg.Exports() {
		m[s.Config.Name] = s.Config.Path
	}
	return m
}

func (e *txEnv) errors() float64 { return testutil.ToFloat64(e.d.reloads.WithLabelValues("error")) }

// TestReloadRefusedChangesNothing: a file half-written (empty, comments
// only, cut before or in exports, cut in a path), a path mistyped, a FIFO,
// a second name of a served file, two exports of one file, a shrink: each
// reload is refused, says why (with the file and line where there is
// one), counts as an error, and changes nothing: every export stays as it
// was, and no file a refused reload created is left.
func TestReloadRefusedChangesNothing(t *testing.T) {
	e := startTx(t, func(e *txEnv) string {
		return "exports:\n  - name: a\n    path: " + e.img("a") + "\n    size: 1M\n  - name: b\n    path: " + e.img("b") + "\n    size: 1M\n"
	})
	fifo := filepath.Join(e.dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(e.dir, "link.img")
	if err := os.Symlink(e.img("a"), link); err != nil {
		t.Fatal(err)
	}
	good := "exports:\n  - name: a\n    path: " + e.img("a") + "\n    size: 1M\n  - name: b\n    path: " + e.img("b") + "\n    size: 1M\n"
	before := e.exports()
	for i, c := range []struct {
		name, content, want string
	}{
		{"empty", "", e.cfg + ": empty file"},
		{"comments only", "# rblkd.yaml\n", e.cfg + ": empty file"},
		{"settings only (cut before exports)", "cache_size: 4M\n", e.cfg + " configures no exports: refusing to remove every export (is the file half-written?)"},
		{"exports: and nothing", "cache_size: 4M\nexports:\n", e.cfg + " configures no exports"},
		{"cut in an export's key", "exports:\n  - name: a\n    pa", e.cfg + ":3: "},
		{"cut in a's path", "exports:\n  - name: a\n    path: " + e.img("a")[:len(e.img("a"))-3] + "\n    size: 1M\n  - name: b\n    path: " + e.img("b") + "\n",
			e.cfg + `:2: export "a": path ` + e.img("a")[:len(e.img("a"))-3] + " does not exist: a reload does not create a new file for an export it serves"},
		{"b's path mistyped", "exports:\n  - name: a\n    path: " + e.img("a") + "\n  - name: b\n    path: " + e.img("bb") + "\n",
			e.cfg + `:4: export "b": path ` + e.img("bb") + " does not exist"},
		{"a new export mistyped, with a new one created", good + "  - name: new\n    path: " + e.img("new") + "\n    size: 1M\n  - name: c\n    path: " + e.img("cc") + "\n",
			e.cfg + `:11: export "c": open ` + e.img("cc") + ": no such file or directory"},
		{"a FIFO, read-only", good + "  - name: f\n    path: " + fifo + "\n    read_only: true\n", e.cfg + `:8: export "f": ` + fifo + " is a FIFO: want a regular file or a block device"},
		{"a FIFO", good + "  - name: f\n    path: " + fifo + "\n", fifo + " is a FIFO"},
		{"a's file by a link", good + "  - name: l\n    path: " + link + "\n", `export "l": ` + link + ` is the same file as export "a" (` + e.img("a") + ")"},
		{"a's file by d/../", good + "  - name: l\n    path: " + e.dir + "/x/../a.img\n", `is the same file as export "a"`},
		{"two new exports of one file", good + "  - name: n1\n    path: " + e.img("new") + "\n    size: 1M\n  - name: n2\n    path: " + e.dir + "/./new.img\n",
			`export "n2": ` + e.dir + `/./new.img is the same file as export "n1" (` + e.img("new") + ")"},
		{"a shrink", "exports:\n  - name: a\n    path: " + e.img("a") + "\n    size: 64K\n  - name: b\n    path: " + e.img("b") + "\n    size: 1M\n",
			e.cfg + `:2: export "a": size 65536 is smaller than the volume's 1048576 bytes`},
	} {
		if err := os.MkdirAll(filepath.Join(e.dir, "x"), 0o700); err != nil {
			t.Fatal(err)
		}
		e.write(c.content)
		msg, err := reloadLocked(context.Background(), e.d)
		if err == nil || !refused(err) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: reload: %q, %v; want it refused saying %q", c.name, msg, err, c.want)
		}
		if got := e.exports(); !reflect.DeepEqual(got, before) {
			t.Errorf("%s: exports after the refused reload %v, want %v", c.name, got, before)
		}
		if _, err := os.Stat(e.img("new")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: the refused reload left the file it created: %v", c.name, err)
		}
		if got := e.errors(); got != float64(i+1) {
			t.Errorf("%s: rblkd_config_reloads_total{result=\"error\"} = %v, want %d", c.name, got, i+1)
		}
		if n := e.logs.FilterMessage("reload refused: nothing changed, the running exports stay").Len(); n != i+1 {
			t.Errorf("%s: %d refusals logged, want %d", c.name, n, i+1)
		}
		if s := reloadStatus(msg, err); !strings.HasPrefix(s, "reload refused, nothing changed: ") || !strings.Contains(s, c.want) {
			t.Errorf("%s: STATUS=%q", c.name, s)
		}
	}
	// A settings-only file is fine where the exports come from the
	// command line: nothing to remove.
	e.d.flagExports = []target.ExportConfig{{Name: "a", Path: e.img("a"), Size: 1 << 20}, {Name: "b", Path: e.img("b"), Size: 1 << 20}}
	e.write("cache_size: 4M\n")
	if msg, err := reloadLocked(context.Background(), e.d); err != nil || msg != "cache_size needs a restart" {
		t.Errorf("reload of a settings-only file with --export's: %q, %v", msg, err)
	}
}

// TestReloadMovesFiles: a rename (the file moves from export a to export
// r) removes a, then adds r; a path changed to another name of the file
// is an update that leaves the export served; two exports that trade
// files are removed, then added again.
func TestReloadMovesFiles(t *testing.T) {
	e := startTx(t, func(e *txEnv) string {
		return "exports:\n" +
			"  - {name: a, path: " + e.img("a") + ", size: 1M}\n" +
			"  - {name: k, path: " + e.img("k") + ", size: 1M}\n" +
			"  - {name: x, path: " + e.img("x") + ", size: 1M}\n" +
			"  - {name: y, path: " + e.img("y") + ", size: 1M}\n"
	})
	link := filepath.Join(e.dir, "k-link.img")
	if err := os.Symlink(e.img("k"), link); err != nil {
		t.Fatal(err)
	}
	e.write("exports:\n" +
		"  - {name: r, path: " + e.img("a") + "}\n" +
		"  - {name: k, path: " + link + ", size: 1M}\n" +
		"  - {name: x, path: " + e.img("y") + ", size: 1M}\n" +
		"  - {name: y, path: " + e.img("x") + ", size: 1M}\n")
	msg, err := reloadLocked(context.Background(), e.d)
	if err != nil {
		t.Fatal(err)
	}
	if want := "removed a, added r, replaced x, replaced y, updated k"; msg != want {
		t.Errorf("reload: %q, want %q", msg, want)
	}
	want := map[string]string{"r": e.img("a"), "k": link, "x": e.img("y"), "y": e.img("x")}
	if got := e.exports(); !reflect.DeepEqual(got, want) {
		t.Errorf("exports %v, want %v", got, want)
	}
	if n := e.logs.FilterMessage("export's path changed: another name of the same file").Len(); n != 1 {
		t.Errorf("k's new path logged %d times, want once", n)
	}
	if n := e.logs.FilterMessage("export removed").FilterField(zap.String("name", "k")).Len(); n != 0 {
		t.Error("k was removed for another name of its file")
	}
}

// TestReloadPartial: a removal whose write-back fails (an injected EIO
// from fdatasync) keeps its export, and the add that waited for it (its
// file moving to another name) is not done; the rest of the reload is;
// the reload is reported incomplete, with what was done and what not.
func TestReloadPartial(t *testing.T) {
	e := startTx(t, func(e *txEnv) string {
		return "exports:\n" +
			"  - {name: stuck, path: " + e.img("stuck") + ", size: 1M}\n" +
			"  - {name: gone, path: " + e.img("gone") + ", size: 1M}\n" +
			"  - {name: k, path: " + e.img("k") + ", size: 1M}\n"
	})
	e.failSync.Store(true)
	e.write("exports:\n" +
		"  - {name: moved, path: " + e.img("stuck") + "}\n" +
		"  - {name: k, path: " + e.img("k") + ", size: 1M, shared: true}\n" +
		"  - {name: fresh, path: " + e.img("fresh") + ", size: 1M}\n")
	msg, err := reloadLocked(context.Background(), e.d)
	if err == nil || refused(err) {
		t.Fatalf("reload: %q, %v; want it incomplete", msg, err)
	}
	if want := "added fresh, removed gone, updated k"; msg != want {
		t.Errorf("done: %q, want %q", msg, want)
	}
	for _, w := range []string{`remove export "stuck": write back: fdatasync "stuck": input/output error (the export stays)`,
		`export "moved" not added: export "stuck", which serves its file, could not be removed`} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("reload error %q lacks %q", err, w)
		}
	}
	if s := reloadStatus(msg, err); !strings.HasPrefix(s, "reload incomplete: done: added fresh, removed gone, updated k; not done: ") {
		t.Errorf("STATUS=%q", s)
	}
	want := map[string]string{"stuck": e.img("stuck"), "k": e.img("k"), "fresh": e.img("fresh")}
	if got := e.exports(); !reflect.DeepEqual(got, want) {
		t.Errorf("exports %v, want %v", got, want)
	}
	if e.errors() != 1 || e.logs.FilterMessage("reload incomplete: what could be done was, the rest stays as it was").Len() != 1 {
		t.Errorf("incomplete reload: %v errors counted, logs %v", e.errors(), e.logs.All())
	}
	// The disk is back: the same reload finishes the move.
	e.failSync.Store(false)
	if msg, err := reloadLocked(context.Background(), e.d); err != nil || msg != "removed stuck, added moved" {
		t.Errorf("reload once the disk is back: %q, %v", msg, err)
	}
}

// TestAdminTransactions: rblkd export add, remove and grow check
// everything before they change anything: an add of a FIFO, of a second
// name of a served file, a --save of an export the file lacks are
// refused, and neither the exports nor the file change; a refused add
// leaves no file and no staged copy behind.
func TestAdminTransactions(t *testing.T) {
	e := startTx(t, func(e *txEnv) string {
		return "# kept\nexports:\n  - {name: a, path: " + e.img("a") + ", size: 1M}\n"
	})
	ctx := context.Background()
	fifo := filepath.Join(e.dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	orig, _ := os.ReadFile(e.cfg)
	// An export added without --save: the file does not have it.
	if r := e.d.handle(ctx, admin.Request{Command: admin.CmdAdd, Export: &admin.Export{Name: "t", Path: e.img("t"), Size: 1 << 20}}); !r.OK {
		t.Fatal(r.Error)
	}
	before := e.exports()
	for _, c := range []struct {
		req  admin.Request
		want string
	}{
		{admin.Request{Command: admin.CmdAdd, Export: &admin.Export{Name: "f", Path: fifo, ReadOnly: true}, Save: true},
			`add export: export "f": ` + fifo + " is a FIFO: want a regular file or a block device"},
		{admin.Request{Command: admin.CmdAdd, Export: &admin.Export{Name: "f", Path: fifo}}, fifo + " is a FIFO"},
		{admin.Request{Command: admin.CmdAdd, Export: &admin.Export{Name: "l", Path: e.dir + "/./a.img"}, Save: true},
			`add export "l": ` + e.dir + `/./a.img is the same file as export "a" (` + e.img("a") + ")"},
		{admin.Request{Command: admin.CmdAdd, Export: &admin.Export{Name: "a", Path: e.img("new"), Size: 1 << 20}, Save: true}, "export exists"},
		{admin.Request{Command: admin.CmdRemove, Name: "t", Save: true}, "--save: export \"t\" is not in " + e.cfg + ": nothing changed"},
		{admin.Request{Command: admin.CmdGrow, Name: "t", Size: 2 << 20, Save: true}, "--save: export \"t\" is not in " + e.cfg + ": nothing changed"},
		{admin.Request{Command: admin.CmdGrow, Name: "a", Size: 4096}, "cannot shrink"},
	} {
		r := e.d.handle(ctx, c.req)
		if r.OK || !strings.Contains(r.Error, c.want) {
			t.Errorf("%s %+v: %+v, want a refusal saying %q", c.req.Command, c.req, r, c.want)
		}
		if got := e.exports(); !reflect.DeepEqual(got, before) {
			t.Errorf("%s: exports after a refusal %v, want %v", c.req.Command, got, before)
		}
	}
	if st := e.d.status("t"); st == nil || st.Size != 1<<20 {
		t.Errorf("t after a refused grow: %+v", st)
	}
	if b, _ := os.ReadFile(e.cfg); string(b) != string(orig) {
		t.Errorf("refusals changed the file:\n%s", b)
	}
	if _, err := os.Stat(e.img("new")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused add left its file: %v", err)
	}
	if entries, _ := os.ReadDir(e.dir); len(entries) != 4 { // rblkd.yaml, a.img, t.img, fifo
		var names []string
		for _, de := range entries {
			names = append(names, de.Name())
		}
		t.Errorf("the folder holds %v: a staged copy left behind?", names)
	}
	// An add, a grow and a remove with --save: done and saved.
	for _, req := range []admin.Request{
		{Command: admin.CmdAdd, Export: &admin.Export{Name: "n", Path: e.img("n"), Size: 1 << 20}, Save: true},
		{Command: admin.CmdGrow, Name: "n", Size: 2 << 20, Save: true},
		{Command: admin.CmdRemove, Name: "a", Save: true},
	} {
		if r := e.d.handle(ctx, req); !r.OK || !strings.Contains(r.Message, "saved to "+e.cfg) {
			t.Errorf("%s: %+v", req.Command, r)
		}
	}
	c, err := config.Load(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if ex := c.ExportConfigs(); len(ex) != 1 || ex[0].Name != "n" || ex[0].Size != 2<<20 {
		t.Errorf("saved exports %+v, want n of 2M", ex)
	}
}

// TestAdminWaitYields: an admin command or reload waiting behind another
// (one that holds the daemon's lock, as a removal draining its sessions
// does) gives up when its context ends (SIGTERM, the client's timeout),
// changing nothing; an add of a FIFO is refused at once meanwhile, without
// waiting for the lock.
func TestAdminWaitYields(t *testing.T) {
	e := startTx(t, func(e *txEnv) string {
		return "exports:\n  - {name: a, path: " + e.img("a") + ", size: 1M}\n"
	})
	if err := e.d.lock(context.Background()); err != nil { // the command in progress
		t.Fatal(err)
	}
	defer e.d.unlock()
	fifo := filepath.Join(e.dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := e.d.handle(ctx, admin.Request{Command: admin.CmdAdd, Export: &admin.Export{Name: "f", Path: fifo}})
	if r.OK || !strings.Contains(r.Error, fifo+" is a FIFO") {
		t.Errorf("add of a FIFO while the lock is held: %+v", r)
	}
	results := make(chan admin.Response, 3)
	for _, req := range []admin.Request{{Command: admin.CmdRemove, Name: "a"}, {Command: admin.CmdReload},
		{Command: admin.CmdAdd, Export: &admin.Export{Name: "n", Path: e.img("n"), Size: 1 << 20}}} {
		go func() { results <- e.d.handle(ctx, req) }()
	}
	cancel()
	for range 3 {
		// (an add may see the end before it opens its file)
		if r := <-results; r.OK || !strings.Contains(r.Error, "context canceled") {
			t.Errorf("a command waiting when its context ended: %+v", r)
		}
	}
	if got := e.exports(); len(got) != 1 || got["a"] == "" {
		t.Errorf("exports %v, want a alone", got)
	}
	if _, err := os.Stat(e.img("n")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("an add that gave up left its file: %v", err)
	}
}
