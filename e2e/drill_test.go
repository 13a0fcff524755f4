package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rblk/rblk/csidriver"
	"github.com/rblk/rblk/manage/remote"
)

// TestNodeFailureDrill: a volume moves off a node that goes on writing,
// through rblk-csi's controller (in this process, as rblk-csi --mode
// controller runs it) and a real rblkd with pools, its management API and
// authentication. Node A has the volume published and writes 0xaa over
// its first 4 MiB without pause; node B's publish is refused while A holds
// it; ControllerUnpublishVolume(A) fences A before it answers; B is
// published, attaches and writes 0xbb there. A's writes after the fence
// fail (its attach ends, told it was fenced), and the file holds B's bytes
// alone. It logs the time from ControllerUnpublishVolume to B's first
// write. rblk-attach's NBD sockets stand in for the nodes here, which need
// no root; TestNodeFailureDrillNodes runs the drill with two node services
// on /dev/nbdN.
func TestNodeFailureDrill(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io", "fio")
	authFile, secretA, secretB := authFiles(t)
	tg, ctrl, dir := csiTarget(t, authFile)
	ctx, cancel := context.WithTimeout(context.Background(), patient(cmdTimeout))
	defer cancel()
	capability := blockCapability()
	vol := createVolume(ctx, t, ctrl, "pvc-drill", capability)
	export := vol.VolumeContext[csidriver.CtxExport]
	publish := func(node string) error {
		_, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.VolumeId, NodeId: node, VolumeCapability: capability})
		return err
	}
	if err := publish("host-a"); err != nil {
		t.Fatal(err)
	}
	a := startAttach(t, tg, export, "--host-id", "host-a", "--secret-file", secretA)
	fioA := startFio(t, append(append([]string{"--name=node-a"}, fioTarget(a.uri(""))...), "--rw=write", "--bs=64k", "--size=4m",
		"--iodepth=4", "--time_based", "--runtime=120", "--buffer_pattern=0xaa")...)
	// A is writing.
	pollUntil(t, 60*time.Second, "node A's writes to reach the target", func() bool {
		v, _ := metricSum(scrape(t, tg.metrics), "rblkd_written_bytes_total", `export="`+export+`"`)
		return v >= 8<<20
	})
	if err := publish("host-b"); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("publish to node B while node A holds the volume: %v, want FailedPrecondition", err)
	}

	start := time.Now()
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.VolumeId, NodeId: "host-a"}); err != nil {
		t.Fatal(err)
	}
	fenced := time.Since(start)
	if err := publish("host-b"); err != nil {
		t.Fatal(err)
	}
	b := startAttach(t, tg, export, "--host-id", "host-b", "--secret-file", secretB)
	qemuIO(t, b.uri(""), []qop{{kind: 'w', off: 0, n: 64 << 10, pattern: 0xbb}})
	firstWrite := time.Since(start)
	qemuIO(t, b.uri(""), []qop{{kind: 'w', off: 64 << 10, n: 4<<20 - 64<<10, pattern: 0xbb}, {kind: 'f'}})
	t.Logf("node failure drill: ControllerUnpublishVolume (node A fenced) took %v; node B's first write came %v after it", fenced.Round(time.Millisecond), firstWrite.Round(time.Millisecond))

	// A's writes after the fence failed: its attach ended, told it was
	// fenced, and fio with it.
	select {
	case <-a.done:
	case <-time.After(patient(stopTimeout)):
		t.Fatalf("node A's rblk-attach still runs after its unpublish\n%s", a.out.String())
	}
	if a.waitErr == nil || !strings.Contains(a.out.String(), `host "host-a" fenced off export "`+export+`"`) {
		t.Fatalf("node A's rblk-attach: %v, want a failure that says it was fenced\n%s", a.waitErr, a.out.String())
	}
	a.checkOutput(t)
	<-fioA.done
	if fioA.r.code == 0 && !strings.Contains(fioA.r.stdout+fioA.r.stderr, "error") {
		t.Errorf("node A's writes after the fence did not fail: fio exit %d\n%s", fioA.r.code, fioA.r.stderr)
	}
	qemuIO(t, b.uri(""), []qop{{kind: 'r', off: 0, n: 4 << 20, pattern: 0xbb}})
	b.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	onlyB(t, filepath.Join(dir, "fast", "pvc-drill.img"))
}

// blockCapability is a single-node writer's block volume.
func blockCapability() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
}

// createVolume creates a 64 MiB volume name with capability through ctrl.
func createVolume(ctx context.Context, t *testing.T, ctrl *csidriver.Controller, name string, capability *csi.VolumeCapability) *csi.Volume {
	t.Helper()
	cr, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{capability}})
	if err != nil {
		t.Fatal(err)
	}
	return cr.Volume
}

// onlyB fails t unless the first 4 MiB of file are node B's 0xbb.
func onlyB(t *testing.T, file string) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b[:4<<20], bytes.Repeat([]byte{0xbb}, 4<<20)) {
		i := 0
		for b[i] == 0xbb {
			i++
		}
		t.Fatalf("the file holds %#x at %d: not node B's bytes alone (a write of node A's landed after its fence?)", b[i], i)
	}
}

// csiTarget starts rblkd with a pool "fast" (256 MiB, in dir/fast), its
// management API (certificates made by rblkd cert) and authFile, and
// returns it with an rblk-csi controller (as rblk-csi --mode controller
// runs it) whose inventory names it, storage-1.
func csiTarget(t *testing.T, authFile string) (tg *target, ctrl *csidriver.Controller, dir string) {
	t.Helper()
	tgs, ctrl, dir := csiTargets(t, authFile, "")
	return tgs[0].tg, ctrl, dir
}

// csiStorage is a target of csiTargets: its rblkd and its config.
type csiStorage struct {
	tg     *target
	config string
}

// restart starts s's rblkd again, on the address initiators know (the
// last one is gone: killed, or stopped).
func (s *csiStorage) restart(t *testing.T, authFile string) {
	t.Helper()
	s.tg = startTargetOn(t, s.tg.addr, nil, "--config", s.config, "--auth-file", authFile)
}

// csiTargets starts an rblkd per zone, storage-1, storage-2, ..., as
// csiTarget does, each pool "fast" labeled topology.rblk.io/zone=ZONE (no
// label for ""), and returns them with one rblk-csi controller whose
// inventory names them all.
func csiTargets(t *testing.T, authFile string, zones ...string) (tgs []*csiStorage, ctrl *csidriver.Controller, dir string) {
	t.Helper()
	dir = t.TempDir()
	tlsDir := filepath.Join(dir, "tls")
	f := func(name string) string { return filepath.Join(tlsDir, name) }
	for _, args := range [][]string{{"ca"}, {"client", "--name", "rblk-csi-controller"}} {
		mustRun(t, cmdTimeout, rblkdBin, append(append([]string{"cert"}, args...), "--dir", tlsDir)...)
	}
	var inv csidriver.InventoryFile
	for i, zone := range zones {
		name := fmt.Sprintf("storage-%d", i+1)
		mustRun(t, cmdTimeout, rblkdBin, "cert", "server", "--name", name, "--host", "127.0.0.1", "--dir", tlsDir)
		sdir := filepath.Join(dir, name)
		if i == 0 {
			sdir = dir // (csiTarget's layout: dir/fast)
		}
		labels := ""
		if zone != "" {
			labels = "    labels: {topology.rblk.io/zone: " + zone + "}\n"
		}
		apiAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		cfg := filepath.Join(sdir, "rblkd.yaml")
		conf := fmt.Sprintf("pools:\n  - name: fast\n    directory: %s\n    capacity: 256M\n%smanagement:\n  listen: %s\n  cert: %s\n  key: %s\n  client_ca: %s\n"+
			"  clients:\n    - identity: rblk-csi-controller\n      pools: [\"*\"]\n",
			filepath.Join(sdir, "fast"), labels, apiAddr, f(name+".crt"), f(name+".key"), f("ca.crt"))
		if err := os.MkdirAll(sdir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
			t.Fatal(err)
		}
		tg := startTarget(t, nil, "--config", cfg, "--auth-file", authFile)
		if err := waitUntil(tg.proc, 20*time.Second, func() bool { return strings.Contains(tg.out.String(), "management API") }); err != nil {
			t.Fatal(err)
		}
		tgs = append(tgs, &csiStorage{tg: tg, config: cfg})
		inv.Targets = append(inv.Targets, csidriver.TargetConfig{Name: name, Management: apiAddr, Address: tg.addr, Transport: e2eTransport()})
	}
	tc, err := remote.ClientTLS(f("rblk-csi-controller.crt"), f("rblk-csi-controller.key"), f("ca.crt"), "")
	if err != nil {
		t.Fatal(err)
	}
	targets, err := csidriver.NewInventory(&inv, tc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { targets.Close() })
	return tgs, csidriver.NewController(targets, nil), dir
}
