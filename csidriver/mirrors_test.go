package csidriver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"

	"github.com/rblk/rblk/mirror"
	"github.com/rblk/rblk/mirror/mirrortest"
)

// TestMirrorAttacher stages a mirror as the node plugin does: both copies
// attached (with the mirror's rblk-attach flags), the array created in
// sync over them; DEGRADED while a member is failed or resyncs; after a
// restart of the plugin (Resume) a failed member is re-added; the array
// grows; Detach stops it and detaches both copies. A volume of one copy
// goes to the RBLKAttacher as it is.
func TestMirrorAttacher(t *testing.T) {
	ctx := context.Background()
	f := mirrortest.New(t)
	dev0, dev1 := f.Device("nbd0"), f.Device("nbd1")
	bin := fakeAttach(t, false)
	for export, dev := range map[string]string{"fast:a": dev0, "fast:b": dev1} {
		if err := os.WriteFile(filepath.Join(filepath.Dir(bin), "device-"+export), []byte(dev), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The copies' rblk-attach say they reconnect: the supervisor leaves
	// the array alone (it re-adds members that serve) until they are up.
	if err := os.WriteFile(filepath.Join(filepath.Dir(bin), "state"), []byte("reconnecting"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := &RBLKAttacher{Bin: bin, HostID: "n1", StateDir: filepath.Join(t.TempDir(), "state"), Args: []string{"--queues=2"}}
	md := mirror.Options{Run: f.Run, SysBlock: f.SysBlock(), DevDir: f.DevDir()}
	metrics := mirror.NewMetrics()
	m := &MirrorAttacher{A: a, Every: time.Hour, MD: md, Metrics: metrics, Logger: zaptest.NewLogger(t)}
	const id = "s1/fast/s2/fast/pvc-1"
	volCtx := map[string]string{CtxAddress: "192.0.2.1:7660", CtxExport: "fast:a", CtxTransport: "tcp",
		CtxMirrorAddress: "192.0.2.2:7660", CtxMirrorExport: "fast:b", CtxMirrorTransport: "tcp"}

	if _, err := m.Attach(ctx, id, map[string]string{CtxAddress: "192.0.2.1:7660", CtxExport: "fast:a"}); err == nil {
		t.Fatal("a mirror attached without its second copy's context")
	}
	dev, err := m.Attach(ctx, id, volCtx)
	if err != nil || dev != f.Dev("md0") {
		t.Fatalf("Attach: %q, %v", dev, err)
	}
	if !f.Called("--create " + filepath.Join(f.DevDir(), "md", "pvc-1")) {
		t.Fatalf("no array created: %q", f.Calls())
	}
	create := f.Calls()[len(f.Calls())-1]
	if !strings.Contains(create, "--assume-clean") || !strings.HasSuffix(create, dev0+" "+dev1) {
		t.Errorf("create: %q; want both new copies, in sync", create)
	}
	args, _ := os.ReadFile(filepath.Join(filepath.Dir(bin), "args"))
	if !strings.Contains(string(args), "--export fast:b") || !strings.Contains(string(args), strings.Join(DefaultMirrorArgs, " ")+" --queues=2") {
		t.Errorf("the second copy's rblk-attach arguments: %q", args)
	}
	if d, ok := m.Device(id); !ok || d != dev {
		t.Errorf("Device: %q, %v", d, ok)
	}
	n := &Node{HostID: "n1", Attacher: m}
	health := func() []*csi.VolumeHealth_VolumeHealthEntry {
		t.Helper()
		h, err := n.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id})
		if err != nil {
			t.Fatal(err)
		}
		return h.VolumeHealth.HealthStatuses
	}
	if h := health(); len(h) != 0 {
		t.Errorf("health of a whole mirror: %v", h)
	}
	f.SetState(dev1, "faulty")
	if h := health(); len(h) != 1 || h[0].Status != csi.VolumeHealthErrorType_DEGRADED || h[0].Reason != "Degraded" ||
		!strings.Contains(h[0].Message, "1 of 2 copies serve") || !strings.Contains(h[0].Message, "the target 192.0.2.10:7480 is unreachable") || !strings.Contains(h[0].Message, "fails fast") {
		t.Errorf("health with a failed member: %v", h)
	}
	f.Lock()
	f.Member[dev1] = "spare"
	f.Sync()
	os.WriteFile(filepath.Join(f.SysBlock(), "md0", "md", "sync_action"), []byte("recover\n"), 0o644)
	os.WriteFile(filepath.Join(f.SysBlock(), "md0", "md", "sync_completed"), []byte("16384 / 65536\n"), 0o644)
	f.Unlock()
	if h := health(); len(h) != 1 || h[0].Status != csi.VolumeHealthErrorType_DEGRADED || h[0].Reason != "Resyncing" || !strings.Contains(h[0].Message, "25% done, 24 MiB to go") {
		t.Errorf("health while resyncing: %v", h)
	}
	if testutil.CollectAndCount(metrics, "rblk_mirror_resyncing") != 1 {
		t.Error("the staged mirror is not in the metrics")
	}

	// The plugin restarts: a new attacher supervises the array again, and
	// re-adds the failed member once its copy serves.
	m.Close()
	f.SetState(dev1, "faulty")
	statuses, _ := filepath.Glob(filepath.Join(a.StateDir, "[0-9]*.json"))
	for _, p := range statuses {
		b, _ := os.ReadFile(p)
		if err := os.WriteFile(p, []byte(strings.Replace(string(b), `"state":"reconnecting"`, `"state":"up"`, 1)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	m2 := &MirrorAttacher{A: &RBLKAttacher{Bin: bin, HostID: "n1", StateDir: a.StateDir, Args: a.Args}, Every: 5 * time.Millisecond, MD: md, Logger: zaptest.NewLogger(t)}
	defer m2.Close()
	if k, err := m2.Resume(); k != 1 || err != nil {
		t.Fatalf("Resume: %d, %v", k, err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if !f.WaitCalled(wctx, filepath.Join(f.DevDir(), "md", "pvc-1")+" --re-add "+dev1) {
		t.Fatalf("the failed member was not re-added: %q", f.Calls())
	}

	devSize = func(string) (int64, error) { return 256 << 20, nil }
	defer func() { devSize = deviceSize }()
	if size, err := m2.Grow(ctx, id, 64<<20); err != nil || size != 128<<20 || !f.Called("--grow") {
		t.Errorf("Grow: %d, %v", size, err)
	}

	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := m2.Detach(dctx, id); err != nil {
		t.Fatal(err)
	}
	if !f.Called("--stop") {
		t.Error("Detach did not stop the array")
	}
	for _, leg := range []string{id + "#0", id + "#1"} {
		if _, ok := a.Device(leg); ok {
			t.Errorf("copy %s still attached", leg)
		}
	}
	if _, err := os.Stat(m2.recordPath(id)); !os.IsNotExist(err) {
		t.Errorf("the mirror's record after Detach: %v", err)
	}

	// One copy: the RBLKAttacher's.
	if d, err := m2.Attach(ctx, "s1/fast/pvc-2", map[string]string{CtxAddress: "192.0.2.1:7660", CtxExport: "fast:c"}); err != nil || d != "/dev/null" {
		t.Fatalf("Attach of a volume of one copy: %q, %v", d, err)
	}
	if err := m2.Detach(dctx, "s1/fast/pvc-2"); err != nil {
		t.Fatal(err)
	}
}
