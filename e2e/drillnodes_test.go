package e2e

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rblk/rblk/csidriver"
)

// TestNodeFailureDrillNodes is the node-failure drill with two rblk-csi
// node services (in this process, with host IDs host-a and host-b, as
// rblk-csi --mode node runs them on two nodes) staging a block volume on
// the kernel's /dev/nbdN: node A stages and publishes it, and fio writes
// 0xaa over its first 4 MiB without pause; node B's publish is refused
// while A holds it; ControllerUnpublishVolume(A) fences A; B is published,
// stages and writes 0xbb there. A's writes after the fence fail, A's
// unstage works without its attach, and the file holds B's bytes alone.
func TestNodeFailureDrillNodes(t *testing.T) {
	t.Parallel()
	if e2e.device != "nbd" {
		notApplicable(t, "the node services stage volumes on the kernel's /dev/nbdN (RBLK_E2E_DEVICE=nbd)")
	}
	needTools(t, "fio", "blkid")
	authFile, secretA, secretB := authFiles(t)
	tg, ctrl, dir := csiTarget(t, authFile)
	ctx, cancel := context.WithTimeout(context.Background(), patient(6*time.Minute))
	defer cancel()

	block := blockCapability()
	vol := createVolume(ctx, t, ctrl, "pvc-nodes", block)
	export := vol.VolumeContext[csidriver.CtxExport]
	type nodeOf struct {
		name            string
		svc             *csidriver.Node
		staging, target string
		publishCtx      map[string]string
	}
	newNode := func(host, secret string) *nodeOf {
		state := filepath.Join(dir, host)
		att := &csidriver.RBLKAttacher{Bin: attachBin, HostID: host, SecretFile: secret, StateDir: state}
		return &nodeOf{name: host, svc: &csidriver.Node{HostID: host, Attacher: att, Logger: zaptest.NewLogger(t)},
			staging: filepath.Join(state, "staging"), target: filepath.Join(state, "device")}
	}
	publish := func(n *nodeOf) error {
		pr, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.VolumeId, NodeId: n.name, VolumeCapability: block})
		if err == nil {
			n.publishCtx = pr.PublishContext
		}
		return err
	}
	stage := func(n *nodeOf) {
		t.Helper()
		if _, err := n.svc.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: n.staging,
			VolumeCapability: block, VolumeContext: vol.VolumeContext, PublishContext: n.publishCtx}); err != nil {
			t.Fatalf("node %s: stage: %v", n.name, err)
		}
		if _, err := n.svc.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: n.staging,
			TargetPath: n.target, VolumeCapability: block, VolumeContext: vol.VolumeContext, PublishContext: n.publishCtx}); err != nil {
			t.Fatalf("node %s: publish: %v", n.name, err)
		}
		t.Cleanup(func() { unix.Unmount(n.target, unix.MNT_DETACH) })
	}
	unstage := func(n *nodeOf) {
		t.Helper()
		if _, err := n.svc.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol.VolumeId, TargetPath: n.target}); err != nil {
			t.Fatalf("node %s: unpublish: %v", n.name, err)
		}
		if _, err := n.svc.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: n.staging}); err != nil {
			t.Fatalf("node %s: unstage: %v", n.name, err)
		}
	}
	a, b := newNode("host-a", secretA), newNode("host-b", secretB)

	if err := publish(a); err != nil {
		t.Fatal(err)
	}
	stage(a)
	fioA := startFio(t, "--name=node-a", "--filename="+a.target, "--ioengine=libaio", "--direct=1", "--rw=write", "--bs=64k",
		"--size=4m", "--iodepth=4", "--time_based", "--runtime=120", "--buffer_pattern=0xaa")
	pollUntil(t, 60*time.Second, "node A's writes to reach the target", func() bool {
		v, _ := metricSum(scrape(t, tg.metrics), "rblkd_written_bytes_total", `export="`+export+`"`)
		return fioA.exited() || v >= 8<<20
	})
	if fioA.exited() {
		t.Fatalf("node A's fio ended early: %s", fioA.r)
	}
	if err := publish(b); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("publish to node B while node A holds the volume: %v, want FailedPrecondition", err)
	}

	start := time.Now()
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.VolumeId, NodeId: a.name}); err != nil {
		t.Fatal(err)
	}
	fenced := time.Since(start)
	if err := publish(b); err != nil {
		t.Fatal(err)
	}
	stage(b)
	first := bytes.Repeat([]byte{0xbb}, 64<<10)
	if err := writeDirect(b.target, first, 0); err != nil {
		t.Fatalf("node B's first write: %v", err)
	}
	firstWrite := time.Since(start)
	mustRun(t, 2*time.Minute, "fio", "--name=node-b", "--filename="+b.target, "--ioengine=libaio", "--direct=1", "--rw=write", "--bs=64k",
		"--offset=64k", "--size=4032k", "--iodepth=4", "--buffer_pattern=0xbb", "--end_fsync=1")
	t.Logf("node failure drill with two node services on /dev/nbdN: ControllerUnpublishVolume (node A fenced) took %v; node B's first write came %v after it",
		fenced.Round(time.Millisecond), firstWrite.Round(time.Millisecond))

	// A's writes after the fence failed.
	select {
	case <-fioA.done:
	case <-time.After(patient(stopTimeout)):
		t.Fatal("node A's fio still runs after its unpublish")
	}
	if fioA.r.code == 0 && !strings.Contains(fioA.r.stdout+fioA.r.stderr, "error") {
		t.Errorf("node A's writes after the fence did not fail: fio exit %d\n%s", fioA.r.code, fioA.r.stderr)
	}
	// Its unstage works with its attach gone (the device, if left, is
	// disconnected).
	unstage(a)
	if s := attachProcs(t, filepath.Join(dir, a.name)); len(s) != 0 {
		t.Fatalf("node A's rblk-attach processes after its unstage: %v", s)
	}
	unstage(b)
	tg.stop(t, stopTimeout)
	onlyB(t, filepath.Join(dir, "fast", "pvc-nodes.img"))
}

// writeDirect writes b at off of the block device path with O_DIRECT and
// O_SYNC: it returns once the write is durable.
func writeDirect(path string, b []byte, off int64) error {
	f, err := os.OpenFile(path, os.O_WRONLY|unix.O_DIRECT|unix.O_SYNC, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	buf, err := unix.Mmap(-1, 0, len(b), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE) // (aligned, for O_DIRECT)
	if err != nil {
		return err
	}
	defer unix.Munmap(buf)
	copy(buf, b)
	_, err = f.WriteAt(buf, off)
	return err
}
