package csidriver

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// fakeAttach writes a stand-in for rblk-attach: it logs the JSON
// "attached" line with device /dev/null (or fails, if fail), then waits
// for its SIGTERM.
func fakeAttach(t *testing.T, fail bool) string {
	t.Helper()
	body := `#!/bin/sh
echo "$@" >"$(dirname "$0")/args"
# The status file, in a state read from the file "state" beside it.
state=up
[ -f "$(dirname "$0")/state" ] && state=$(cat "$(dirname "$0")/state")
# The device: /dev/null, or what the file "device-EXPORT" beside it names.
dev=/dev/null
here=$(dirname "$0")
while [ $# -gt 0 ]; do
	[ "$1" = --state-dir ] && dir=$2
	[ "$1" = --export ] && [ -f "$here/device-$2" ] && dev=$(cat "$here/device-$2")
	shift
done
ticks=$(awk '{print $22}' /proc/$$/stat)
printf '{"pid":%d,"device":"%s","export":"p:v","target":"192.0.2.10:7480","state":"%s","reconnects":3,"since":"2026-11-27T10:00:00Z","start_ticks":%s}' $$ "$dev" "$state" "$ticks" >"$dir/$$.json"
echo '{"level":"info","msg":"volume opened"}' >&2
echo '{"level":"info","msg":"attached","device":"'"$dev"'","export":"p:v"}' >&2
trap 'exit 0' TERM
while :; do sleep 0.05; done
`
	if fail {
		body = "#!/bin/sh\necho 'rblk-attach: open volume: host \"n1\" is not allowed' >&2\nexit 1\n"
	}
	path := filepath.Join(t.TempDir(), "rblk-attach")
	if err := os.WriteFile(path, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestRBLKAttacher(t *testing.T) {
	bin := fakeAttach(t, false)
	a := &RBLKAttacher{Bin: bin, HostID: "n1", SecretFile: "/etc/rblk/secret", StateDir: filepath.Join(t.TempDir(), "state"),
		Args: []string{"--reconnect-timeout=30s"}}
	ctx := context.Background()
	volCtx := map[string]string{CtxAddress: "192.0.2.10:7480", CtxExport: "p:v", CtxTransport: "rdma"}
	dev, err := a.Attach(ctx, "t/p/v", volCtx)
	if err != nil || dev != "/dev/null" {
		t.Fatalf("attach: %q, %v", dev, err)
	}
	args, _ := os.ReadFile(filepath.Join(filepath.Dir(bin), "args"))
	for _, want := range []string{"attach", "--target 192.0.2.10:7480", "--export p:v", "--transport rdma", "--device auto", "--host-id n1", "--secret-file /etc/rblk/secret",
		"--dead-conn-timeout 2m0s", "--reconnect-timeout=30s"} {
		if !strings.Contains(string(args), want) {
			t.Errorf("rblk-attach's arguments %q lack %q", args, want)
		}
	}
	r, ok := a.read("t/p/v")
	if !ok {
		t.Fatal("no record of the attach")
	}
	// What an adoption needs: the device's backend identifier, and the
	// arguments to start rblk-attach with again.
	if r.Backend != "rblk:p:v@192.0.2.10:7480" || !slices.Contains(r.Args, "--export") || slices.Contains(r.Args, "--adopt") {
		t.Errorf("the record %+v", r)
	}
	// Attached already: the same, no second process.
	if dev2, err := a.Attach(ctx, "t/p/v", volCtx); err != nil || dev2 != dev {
		t.Fatalf("attach again: %q, %v", dev2, err)
	}
	if r2, _ := a.read("t/p/v"); r2.PID != r.PID {
		t.Fatalf("a second attach started another rblk-attach (%d, then %d)", r.PID, r2.PID)
	}
	// A plugin restarted: a new attacher finds it by its record.
	b := &RBLKAttacher{Bin: bin, HostID: "n1", StateDir: a.StateDir}
	if d, ok := b.Device("t/p/v"); !ok || d != dev {
		t.Fatalf("a new attacher does not find the running attach: %q, %v", d, ok)
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for range 2 {
		if err := b.Detach(dctx, "t/p/v"); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := a.Device("t/p/v"); ok {
		t.Fatal("still attached after detach")
	}
	if _, err := os.Stat(a.recordPath("t/p/v")); !os.IsNotExist(err) {
		t.Fatalf("the record after detach: %v", err)
	}
}

func TestRBLKAttacherFails(t *testing.T) {
	a := &RBLKAttacher{Bin: fakeAttach(t, true), HostID: "n1", StateDir: t.TempDir()}
	_, err := a.Attach(context.Background(), "t/p/v", map[string]string{CtxAddress: "a:1", CtxExport: "p:v"})
	if err == nil || !strings.Contains(err.Error(), "is not allowed") {
		t.Fatalf("attach with a failing rblk-attach: %v, want its error", err)
	}
	if _, err := a.Attach(context.Background(), "t/p/v", map[string]string{}); err == nil {
		t.Fatal("attach without an address or export succeeded")
	}
}

func TestCheckAttachArgs(t *testing.T) {
	for _, ok := range [][]string{nil, {"--reconnect-timeout=30s"}, {"--request-timeout", "1m", "--queues=4"}, {"--takeover"}} {
		if err := CheckAttachArgs(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range [][]string{{"--export=x"}, {"--device", "/dev/nbd3"}, {"--adopt"}, {"x"}, {"--queues=4", "5"}, {"--state-dir=/tmp"}} {
		if err := CheckAttachArgs(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// Condition tells a reconnecting or failed attach from its rblk-attach's
// status file, and says nothing of one that is up.
func TestRBLKAttacherCondition(t *testing.T) {
	bin := fakeAttach(t, false)
	ctx := context.Background()
	volCtx := map[string]string{CtxAddress: "192.0.2.10:7480", CtxExport: "p:v"}
	for _, c := range []struct{ state, reason, says string }{
		{"up", "", ""},
		{"reconnecting", "Reconnecting", "the target 192.0.2.10:7480 is unreachable since 2026-11-27T10:00:00Z (3 reconnects so far)"},
		{"failed", "Failed", "the session with the target 192.0.2.10:7480 is lost"},
	} {
		if err := os.WriteFile(filepath.Join(filepath.Dir(bin), "state"), []byte(c.state), 0o644); err != nil {
			t.Fatal(err)
		}
		a := &RBLKAttacher{Bin: bin, HostID: "n1", StateDir: filepath.Join(t.TempDir(), "state")}
		if _, err := a.Attach(ctx, "t/p/v", volCtx); err != nil {
			t.Fatal(err)
		}
		// (The stand-in wrote its status file before its "attached" line.)
		cond, _ := a.Condition("t/p/v")
		reason, msg := cond.Reason, cond.Message
		if reason != c.reason || !strings.Contains(msg, c.says) {
			t.Errorf("state %s: condition %q, %q; want %q, %q", c.state, reason, msg, c.reason, c.says)
		}
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if err := a.Detach(dctx, "t/p/v"); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
}
