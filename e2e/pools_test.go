package e2e

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// volumeCmd runs rblkd volume ARGS --json on sock and decodes the answer.
func volumeCmd(t *testing.T, sock string, args ...string) (map[string]any, result) {
	t.Helper()
	r := run(t, cmdTimeout, rblkdBin, append(append([]string{"volume"}, args...), "--json", "--socket", sock)...)
	var out map[string]any
	if r.code == 0 {
		if err := json.Unmarshal([]byte(r.stdout), &out); err != nil {
			t.Fatalf("rblkd volume %s --json: %v\n%s", strings.Join(args, " "), err, r)
		}
	}
	return out, r
}

// mustVolume is volumeCmd that must succeed.
func mustVolume(t *testing.T, sock string, args ...string) map[string]any {
	t.Helper()
	out, r := volumeCmd(t, sock, args...)
	if r.code != 0 {
		t.Fatalf("rblkd volume %s: %s", strings.Join(args, " "), r)
	}
	return out
}

// listed reports whether host sees export in rblk-attach list.
func listed(t *testing.T, tg *target, host, export string) bool {
	t.Helper()
	r := mustRun(t, cmdTimeout, attachBin, "list", "--transport", e2eTransport(), "--target", tg.addr, "--host-id", host, "--json")
	return strings.Contains(r.stdout, `"`+export+`"`)
}

// TestPoolVolumes drives a pool's volume through its life with rblkd
// volume on a real rblkd started with pools: and no exports: create
// (idempotent; bad names, sizes and capacity refused with their codes),
// publish (only that host lists and opens it), IO through rblk-attach,
// unpublish (the host fenced before the answer), publish to another host
// (it reads what the first wrote), expand online, a restart (the pool's
// record is what is served) and delete (drained, the files gone).
func TestPoolVolumes(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	dir := t.TempDir()
	poolDir := filepath.Join(dir, "fast")
	cfg := filepath.Join(dir, "rblkd.yaml")
	sock := filepath.Join(sockDir(t), "run", "rblkd.sock")
	conf := "# rblkd.yaml of an e2e test\nadmin_socket: " + sock + "\npools:\n  - name: fast\n    directory: " + poolDir +
		"\n    capacity: 64M\n    labels: {topology.rblk.io/zone: zone-a}\n"
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	tg := startTarget(t, nil, "--config", cfg)

	out := mustVolume(t, sock, "create", "fast", "pvc-1", "16M")
	if out["created"] != true {
		t.Fatalf("create: %v", out)
	}
	out = mustVolume(t, sock, "create", "fast", "pvc-1", "16M")
	if out["created"] == true {
		t.Fatalf("create again: %v, want it found, not created", out)
	}
	for _, c := range []struct {
		args []string
		code string
	}{
		{[]string{"create", "fast", "a/b", "1M"}, "InvalidArgument"},
		{[]string{"create", "fast", "..", "1M"}, "InvalidArgument"},
		{[]string{"create", "fast", "../../etc/x", "1M"}, "InvalidArgument"},
		{[]string{"create", "fast", "pvc-1", "32M"}, "AlreadyExists"},
		{[]string{"create", "fast", "pvc-2", "64M"}, "ResourceExhausted"},
		{[]string{"create", "slow", "pvc-2", "1M"}, "NotFound"},
		{[]string{"delete", "fast", "nope"}, "NotFound"},
		{[]string{"expand", "fast", "pvc-1", "8M"}, "InvalidArgument"},
	} {
		if _, r := volumeCmd(t, sock, c.args...); r.code == 0 || !strings.Contains(r.stderr, "["+c.code+"]") {
			t.Errorf("rblkd volume %s: %s\nwant a failure with [%s]", strings.Join(c.args, " "), r, c.code)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "etc")); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("a refused name wrote outside the pool")
	}

	const export = "fast:pvc-1"
	if listed(t, tg, "node-a", export) {
		t.Fatal("a volume published to nobody is listed to node-a")
	}
	mustVolume(t, sock, "publish", "fast", "pvc-1", "node-a")
	if !listed(t, tg, "node-a", export) || listed(t, tg, "node-b", export) {
		t.Fatal("after publishing to node-a: want node-a alone to list it")
	}
	a := startAttach(t, tg, export, "--host-id", "node-a")
	qemuIO(t, a.uri(""), []qop{{kind: 'w', off: 0, n: 1 << 20, pattern: 0x41}, {kind: 'f'}})

	out = mustVolume(t, sock, "unpublish", "fast", "pvc-1", "node-a")
	if out["fenced"] != float64(1) {
		t.Fatalf("unpublish: %v, want 1 session fenced", out)
	}
	// node-a's attach learns it (the target's notice) and fails: it
	// does not come back.
	select {
	case <-a.done:
	case <-time.After(patient(stopTimeout)):
		t.Fatalf("rblk-attach of node-a still runs after its unpublish\n%s", a.out.String())
	}
	if a.waitErr == nil || !strings.Contains(a.out.String(), `host "node-a" fenced off export "fast:pvc-1"`) {
		t.Fatalf("rblk-attach of node-a after its unpublish: %v, want a failure that says it was fenced\n%s", a.waitErr, a.out.String())
	}
	a.checkOutput(t)
	if listed(t, tg, "node-a", export) {
		t.Fatal("node-a lists the volume after its unpublish")
	}

	mustVolume(t, sock, "publish", "fast", "pvc-1", "node-b")
	out = mustVolume(t, sock, "expand", "fast", "pvc-1", "32M")
	if v := out["volumes"].([]any)[0].(map[string]any); v["size"] != float64(32<<20) {
		t.Fatalf("expand: %v", out)
	}
	b := startAttach(t, tg, export, "--host-id", "node-b")
	qemuIO(t, b.uri(""), []qop{{kind: 'r', off: 0, n: 1 << 20, pattern: 0x41}, {kind: 'w', off: 31 << 20, n: 1 << 20, pattern: 0x42}, {kind: 'f'}})
	b.stop(t, stopTimeout)

	// A restart serves the pool's record: the volume, 32M, node-b.
	tg.stop(t, stopTimeout)
	tg = startTarget(t, nil, "--config", cfg)
	out = mustVolume(t, sock, "list")
	vols := out["volumes"].([]any)
	if len(vols) != 1 {
		t.Fatalf("volumes after a restart: %v", out)
	}
	v := vols[0].(map[string]any)
	if v["export"] != export || v["size"] != float64(32<<20) || strings.Join(strs(v["hosts"]), ",") != "node-b" {
		t.Fatalf("the volume after a restart: %v", v)
	}
	out = mustVolume(t, sock, "pools")
	if p := out["pools"].([]any)[0].(map[string]any); p["provisioned"] != float64(32<<20) || p["available"] != float64(32<<20) {
		t.Fatalf("pools: %v", out)
	}
	b = startAttach(t, tg, export, "--host-id", "node-b")
	qemuIO(t, b.uri(""), []qop{{kind: 'r', off: 31 << 20, n: 1 << 20, pattern: 0x42}})
	b.stop(t, stopTimeout)

	mustVolume(t, sock, "delete", "fast", "pvc-1")
	entries, err := os.ReadDir(poolDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "pvc-1") {
			t.Errorf("%s left in the pool after delete", e.Name())
		}
	}
	tg.stop(t, stopTimeout)
}

func strs(v any) []string {
	var out []string
	l, _ := v.([]any)
	for _, s := range l {
		out = append(out, s.(string))
	}
	return out
}
