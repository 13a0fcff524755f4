package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// writeConfig writes an rblkd.yaml with the given exports (NAME: PATH,
// SIZE) after the settings.
func writeConfig(t *testing.T, path, settings string, exports ...[3]string) {
	t.Helper()
	var b strings.Builder
	b.WriteString("# rblkd.yaml of an e2e test\n" + settings + "exports:\n")
	for _, e := range exports {
		fmt.Fprintf(&b, "  - name: %s\n    path: %s\n    size: %s\n", e[0], e[1], e[2])
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// adminExports runs rblkd export list --json on sock and returns the
// exports by name.
func adminExports(t *testing.T, sock string) map[string]map[string]any {
	t.Helper()
	r := mustRun(t, cmdTimeout, rblkdBin, "export", "list", "--json", "--socket", sock)
	var out struct {
		Exports []map[string]any `json:"exports"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &out); err != nil {
		t.Fatalf("rblkd export list --json: %v\n%s", err, r)
	}
	m := map[string]map[string]any{}
	for _, e := range out.Exports {
		for _, k := range []string{"name", "path", "size", "configured_size", "read_only", "shared", "allow", "sessions", "writers", "block_device"} {
			if _, ok := e[k]; !ok && k != "configured_size" {
				t.Errorf("rblkd export list --json: export without %q: %v", k, e)
			}
		}
		m[e["name"].(string)] = e
	}
	return m
}

// hup sends SIGHUP to the target and waits until
// rblkd_config_reloads_total{result} reaches want.
func (tg *target) hup(t *testing.T, result string, want float64) {
	t.Helper()
	if err := tg.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitLabeled(t, tg.metrics, "rblkd_config_reloads_total", `result="`+result+`"`, want)
}

// waitLabeled polls addr until the samples of name with label add up to at
// least want, failing t after 30 seconds.
func waitLabeled(t *testing.T, addr, name, label string, want float64) {
	t.Helper()
	deadline := time.Now().Add(patient(30 * time.Second))
	for {
		v, _ := metricSum(scrape(t, addr), name, label)
		if v >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s{%s} = %v at http://%s/metrics, want >= %v", name, label, v, addr, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestReloadUnderIO: while fio writes and verifies export a, a SIGHUP
// reload adds export b and removes export c, which has its own attached
// session with data written: a's session never reconnects and fio's
// verification passes, b is attachable at once, c's session is drained
// and its data is in c's backing file. Then an invalid file on reload is
// refused with its line, and the running configuration (b included)
// stays.
func TestReloadUnderIO(t *testing.T) {
	t.Parallel()
	needTools(t, "fio", "qemu-io")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "rblkd.yaml")
	sock := filepath.Join(sockDir(t), "rblkd.sock")
	settings := "cache_size: 16M\nchunk_size: 256K\ndrain_timeout: 5s\nadmin_socket: " + sock + "\n"
	a, b, c := [3]string{"a", filepath.Join(dir, "a.img"), "32M"}, [3]string{"b", filepath.Join(dir, "b.img"), "8M"},
		[3]string{"c", filepath.Join(dir, "c.img"), "8M"}
	writeConfig(t, cfg, settings, a, c)
	tg := startTarget(t, nil, "--config", cfg)
	atA := startAttach(t, tg, "a")
	atC := startAttach(t, tg, "c")
	// c's data: written through its attach, not flushed by a FUA.
	qemuIO(t, atC.uri("c"), []qop{{kind: 'w', off: 0, n: 1 << 20, pattern: 0x5c}, {kind: 'w', off: 3 << 20, n: 64 << 10, pattern: 0xc5}})

	fio := startFio(t, append(append([]string{"--name=under-reload"}, fioTarget(atA.uri("a"))...), "--rw=randwrite", "--bs=4k",
		"--iodepth=8", "--size=24M", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--exitall_on_error=1", "--verify_state_save=0")...)
	// Reload once fio's writes are going through.
	waitMetric(t, atA.metrics, "rblk_attach_rdma_ops_total", func(v float64) bool { return v >= 200 }, ">= 200")
	writeConfig(t, cfg, settings, a, b)
	tg.hup(t, "ok", 1)
	if fio.exited() {
		t.Log("note: fio ended before the reload did")
	}
	res := fio.wait(t)
	if j := res.Jobs[0]; j.Write.IOBytes != 24<<20 || j.Read.IOBytes < 24<<20 {
		t.Errorf("fio wrote %d and verified %d bytes, want %d both", j.Write.IOBytes, j.Read.IOBytes, 24<<20)
	}
	if v := metric(t, atA.metrics, "rblk_attach_reconnects_total"); v != 0 {
		t.Errorf("a's attach reconnected %v times across the reload, want 0", v)
	}
	out := tg.out.String()
	for _, want := range []string{`export removed	{"name": "c"`, `"sessions_drained": 1`, `export added	{"name": "b"`, `"changes": "added b, removed c"`} {
		if !strings.Contains(out, want) {
			t.Errorf("rblkd's log lacks %q", want)
		}
	}
	if strings.Contains(out, `export removed	{"name": "a"`) || strings.Contains(out, `export added	{"name": "a"`) {
		t.Error("the reload touched export a")
	}
	// c's attach was drained (it flushed: nothing lost) and, the export
	// gone, stopped saying so.
	select {
	case <-atC.done:
		if !strings.Contains(atC.out.String(), "target is shutting down: finishing IO in flight and flushing") ||
			!strings.Contains(atC.out.String(), "no such export") {
			t.Errorf("c's attach does not say it drained and its export is gone:\n%s", atC.out.String())
		}
	case <-time.After(patient(30 * time.Second)):
		t.Errorf("c's attach still runs 30s after its export was removed:\n%s", atC.out.String())
	}
	cimg, err := os.ReadFile(c[1])
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(cimg[:1<<20], bytes.Repeat([]byte{0x5c}, 1<<20)) || !bytes.Equal(cimg[3<<20:3<<20+64<<10], bytes.Repeat([]byte{0xc5}, 64<<10)) {
		t.Errorf("c's backing file does not hold what was written to c before its removal: %s",
			firstDiff(cimg[:1<<20], bytes.Repeat([]byte{0x5c}, 1<<20)))
	}
	atB := startAttach(t, tg, "b")
	qemuIO(t, atB.uri("b"), []qop{{kind: 'w', off: 4096, n: 8192, pattern: 0xbb}, {kind: 'r', off: 4096, n: 8192, pattern: 0xbb}})

	// An invalid file: refused with its line, logged, nothing changes.
	bad := "# rblkd.yaml of an e2e test\n" + settings + "exports:\n  - name: a\n    path: " + a[1] + "\n  - name: d\n    path: /nonexistent\n    size: huge\n"
	if err := os.WriteFile(cfg, []byte(bad), 0o644); err != nil {
		t.Fatal(err)
	}
	tg.hup(t, "error", 1)
	if want := cfg + ":11: exports[1].size:"; !strings.Contains(tg.out.String(), want) {
		t.Errorf("rblkd's log lacks %q:\n%s", want, tg.out.String())
	}
	ex := adminExports(t, sock)
	if len(ex) != 2 || ex["a"] == nil || ex["b"] == nil {
		t.Errorf("exports after an invalid reload: %v, want a and b", ex)
	}
	if ex["a"]["sessions"].(float64) != 1 || ex["b"]["sessions"].(float64) != 1 || ex["b"]["size"].(float64) != 8<<20 {
		t.Errorf("after the invalid reload: a %v, b %v; want one session each, b of 8 MiB", ex["a"], ex["b"])
	}
	qemuIO(t, atB.uri("b"), []qop{{kind: 'r', off: 4096, n: 8192, pattern: 0xbb}})
	if v := metric(t, atB.metrics, "rblk_attach_reconnects_total"); v != 0 {
		t.Errorf("b's attach reconnected %v times across the invalid reload", v)
	}
	atA.stop(t, stopTimeout)
	atB.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// TestConfigRefusedAtStart: rblkd refuses an invalid file at start, naming
// the file, the line and the field; flags given override the file.
func TestConfigRefusedAtStart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	img := filepath.Join(dir, "v.img")
	for _, c := range []struct {
		name, content string
		want          string
	}{
		{"bad size", "transport: tcp\nexports:\n  - name: v\n    path: " + img + "\n  - name: w\n    path: " + img + "\n    size: 12Q\n", ":7: exports[1].size: "},
		{"unknown key", "transport: tcp\ncache: 1G\n", ":2: cache: unknown setting"},
		{"bad duration", "drain_timeout: soon\n", `:1: drain_timeout: "soon": want a duration`},
		{"syntax", "exports:\n  - name: [\n", ":2: YAML:"},
	} {
		path := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "-")+".yaml")
		if err := os.WriteFile(path, []byte(c.content), 0o644); err != nil {
			t.Fatal(err)
		}
		r := run(t, cmdTimeout, rblkdBin, "serve", "--config", path, "--admin-socket", "")
		if r.code == 0 || !strings.Contains(r.stderr, path+c.want) {
			t.Errorf("%s: rblkd serve: %s\nwant a failure naming %q", c.name, r, path+c.want)
		}
	}
	// The file says the other transport (rdma: no device on the build
	// machine): --transport on the command line wins, and the export comes
	// from the file.
	other := map[string]string{"tcp": "rdma", "rdma": "tcp"}[e2eTransport()]
	path := filepath.Join(dir, "ok.yaml")
	writeConfig(t, path, "transport: "+other+"\nadmin_socket: \"\"\n", [3]string{"v", img, "4M"})
	tg := startTarget(t, nil, "--config", path)
	if !strings.Contains(tg.out.String(), `"transport": "`+e2eTransport()) {
		t.Errorf("--transport %s did not override the file's %s:\n%s", e2eTransport(), other, tg.out.String())
	}
	if st, err := os.Stat(img); err != nil || st.Size() != 4<<20 {
		t.Errorf("the file's export was not created: %v", err)
	}
	tg.stop(t, stopTimeout)
}

// TestExportAdmin: rblkd export add, list --json and remove through the
// admin socket; --save writes the changes to the --config file (its
// comments kept), and the next start serves what the file says.
func TestExportAdmin(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "rblkd.yaml")
	sock := filepath.Join(sockDir(t), "run", "rblkd.sock")
	writeConfig(t, cfg, "admin_socket: "+sock+"\n", [3]string{"a", filepath.Join(dir, "a.img"), "4M"})
	tg := startTarget(t, nil, "--config", cfg)
	if st, err := os.Stat(sock); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("admin socket: %v, %v; want mode 0600", st, err)
	}
	adm := func(args ...string) result {
		return mustRun(t, cmdTimeout, rblkdBin, append(append([]string{"export"}, args...), "--socket", sock)...)
	}
	adm("add", "b", filepath.Join(dir, "b.img"), "--size", "2M", "--allow", "host-1,host-2", "--save")
	adm("add", "tmp", filepath.Join(dir, "tmp.img"), "--size", "1M") // not saved
	ex := adminExports(t, sock)
	if len(ex) != 3 || ex["b"]["size"].(float64) != 2<<20 || fmt.Sprint(ex["b"]["allow"]) != "[host-1 host-2]" {
		t.Fatalf("exports after add: %v", ex)
	}
	at := startAttach(t, tg, "b", "--host-id", "host-1")
	qemuIO(t, at.uri("b"), []qop{{kind: 'w', off: 0, n: 65536, pattern: 0x42}})
	if ex := adminExports(t, sock); ex["b"]["sessions"].(float64) != 1 || ex["b"]["writers"].(float64) != 1 {
		t.Errorf("b with one attach: %v", ex["b"])
	}
	// Refusals: a name taken, a shrink, --save of an export not in the file.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"add", "a", filepath.Join(dir, "x.img"), "--size", "1M"}, "export exists"},
		{[]string{"grow", "a", "1M"}, "cannot shrink"},
		{[]string{"remove", "nope"}, "no such export"},
	} {
		r := run(t, cmdTimeout, rblkdBin, append(append([]string{"export"}, c.args...), "--socket", sock)...)
		if r.code == 0 || !strings.Contains(r.stderr, c.want) {
			t.Errorf("rblkd export %s: %s\nwant a failure saying %q", strings.Join(c.args, " "), r, c.want)
		}
	}
	adm("remove", "a", "--save")
	saved, _ := os.ReadFile(cfg)
	if !strings.Contains(string(saved), "# rblkd.yaml of an e2e test") || strings.Contains(string(saved), "name: a\n") ||
		!strings.Contains(string(saved), "name: b\n") || !strings.Contains(string(saved), "allow: [host-1, host-2]") || strings.Contains(string(saved), "name: tmp") {
		t.Errorf("saved file:\n%s", saved)
	}
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	if _, err := os.Stat(sock); err == nil {
		t.Error("the admin socket is left after rblkd stopped")
	}

	// The next start serves what the file says: b (with its data), not a
	// nor tmp.
	tg = startTarget(t, nil, "--config", cfg)
	if ex := adminExports(t, sock); len(ex) != 1 || ex["b"] == nil {
		t.Fatalf("exports after a restart: %v, want b alone", ex)
	}
	at = startAttach(t, tg, "b", "--host-id", "host-2")
	qemuIO(t, at.uri("b"), []qop{{kind: 'r', off: 0, n: 65536, pattern: 0x42}})
	// Without --config, --save is refused.
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	sock2 := filepath.Join(sockDir(t), "rblkd.sock")
	tg = startTarget(t, []string{"v=" + filepath.Join(dir, "v.img") + ",size=1M"}, "--admin-socket", sock2)
	r := run(t, cmdTimeout, rblkdBin, "export", "remove", "v", "--save", "--socket", sock2)
	if r.code == 0 || !strings.Contains(r.stderr, "without --config") {
		t.Errorf("--save without --config: %s", r)
	}
	if ex := adminExports(t, sock2); ex["v"] == nil {
		t.Error("a refused --save removed the export")
	}
	tg.stop(t, stopTimeout)
}

// TestExportGrow grows an attached export online through the admin socket
// (rblkd export grow --save): the backing file grows, the attach learns the
// size (rblk-attach status), a new NBD handshake offers it and IO at the
// new end reaches the file; the old data stays; the file keeps the size
// for the next start.
func TestExportGrow(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "rblkd.yaml")
	img := filepath.Join(dir, "g.img")
	sock := filepath.Join(sockDir(t), "run", "rblkd.sock")
	writeConfig(t, cfg, "admin_socket: "+sock+"\n", [3]string{"g", img, "4M"})
	tg := startTarget(t, nil, "--config", cfg)
	state := filepath.Join(dir, "attach")
	at := startAttach(t, tg, "g", "--state-dir", state)
	qemuIO(t, at.uri("g"), []qop{{kind: 'w', off: 0, n: 65536, pattern: 0x11}, {kind: 'w', off: 4<<20 - 65536, n: 65536, pattern: 0x12}, {kind: 'f'}})

	mustRun(t, cmdTimeout, rblkdBin, "export", "grow", "g", "8M", "--save", "--socket", sock)
	if st, err := os.Stat(img); err != nil || st.Size() != 8<<20 {
		t.Fatalf("backing file after grow: %v, %v; want 8 MiB", st, err)
	}
	// The attach learns the size from the target's notice.
	var es []statusEntry
	if err := waitUntil(at.proc, 30*time.Second, func() bool {
		es = attachStatus(t, state)
		return len(es) == 1 && es[0].Size == 8<<20
	}); err != nil {
		t.Fatalf("rblk-attach status after the grow: %+v, want size 8 MiB: %v\n%s", es, err, at.out.String())
	}
	// A new handshake offers 8 MiB: IO at the new end works, old data stays.
	qemuIO(t, at.uri("g"), []qop{{kind: 'w', off: 8<<20 - 65536, n: 65536, pattern: 0x13}, {kind: 'f'},
		{kind: 'r', off: 0, n: 65536, pattern: 0x11}, {kind: 'r', off: 4<<20 - 65536, n: 65536, pattern: 0x12},
		{kind: 'r', off: 4 << 20, n: 65536, pattern: 0}})
	f, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range f[8<<20-65536:] {
		if b != 0x13 {
			t.Fatalf("backing file byte %d of the new last 64 KiB: %#x, want 0x13 (flushed)", i, b)
		}
	}
	if !strings.Contains(at.out.String(), "grew from 4.0MiB to 8.0MiB") {
		t.Errorf("rblk-attach did not log the grow:\n%s", at.out.String())
	}
	if r := run(t, cmdTimeout, rblkdBin, "export", "grow", "g", "6M", "--socket", sock); r.code == 0 || !strings.Contains(r.stderr, "cannot shrink") {
		t.Errorf("rblkd export grow to a smaller size: %s\nwant a refusal saying it cannot shrink", r)
	}
	if saved, _ := os.ReadFile(cfg); !strings.Contains(string(saved), "size: 8M") {
		t.Errorf("--save did not write the new size:\n%s", saved)
	}
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}
