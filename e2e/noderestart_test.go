package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/csidriver"
	"github.com/rblk/rblk/initiator/kernel"
)

// TestNodePluginRestart: the node plugin restarts under IO the way its
// container does, and the volume grows under its mounted file system.
//
// rblk-csi's node service (in this process, as rblk-csi --mode node runs
// it) stages an ext4 volume of a pool on /dev/nbdN and publishes it; fio
// writes a file there with crc32c in every block. Then the plugin's
// container "restarts": the rblk-attach it started is killed with SIGKILL
// (a container's processes die with it) and a new node service, with a
// new attacher on the same state directory, starts (Recover). It adopts
// the device: fio goes on and passes its verification (no IO error), the
// device is the same /dev/nbdN and stays mounted, and one rblk-attach
// serves it (a NodeStageVolume after the restart starts no second one).
// Then ControllerExpandVolume and NodeExpandVolume grow the volume from 64
// to 128 MiB under the mounted file system, which shows the new size; the
// file still verifies. NodeUnstageVolume detaches the adopted device.
func TestNodePluginRestart(t *testing.T) {
	t.Parallel()
	if e2e.device != "nbd" {
		notApplicable(t, "the node plugin stages volumes on the kernel's /dev/nbdN (RBLK_E2E_DEVICE=nbd)")
	}
	needTools(t, "fio", "mkfs.ext4", "resize2fs", "blkid")
	authFile, secretA, _ := authFiles(t)
	tg, ctrl, dir := csiTarget(t, authFile)
	ctx, cancel := context.WithTimeout(context.Background(), patient(8*time.Minute))
	defer cancel()

	mount := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	vol := createVolume(ctx, t, ctrl, "pvc-restart", mount)
	pr, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.VolumeId, NodeId: "host-a", VolumeCapability: mount})
	if err != nil {
		t.Fatal(err)
	}

	stateDir := filepath.Join(dir, "csi-state")
	// The IO held over the restart: what the dead rblk-attach had read
	// from the kernel and not answered is sent again after the request
	// timeout, so keep it short here (the default waits out
	// --reconnect-timeout first).
	newNode := func() (*csidriver.Node, *csidriver.RBLKAttacher) {
		att := &csidriver.RBLKAttacher{Bin: attachBin, HostID: "host-a", SecretFile: secretA, StateDir: stateDir,
			AdoptTimeout: 2 * time.Minute, Args: []string{"--reconnect-timeout=10s", "--request-timeout=20s"}}
		return &csidriver.Node{HostID: "host-a", Attacher: att, DefaultFS: "ext4", Logger: zaptest.NewLogger(t)}, att
	}
	node, _ := newNode()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	stage := &csi.NodeStageVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: staging, VolumeCapability: mount,
		VolumeContext: vol.VolumeContext, PublishContext: pr.PublishContext}
	if _, err := node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: mount, VolumeContext: vol.VolumeContext, PublishContext: pr.PublishContext}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Unmount(target, unix.MNT_DETACH)
		unix.Unmount(staging, unix.MNT_DETACH)
	})
	backend := "rblk:" + vol.VolumeContext[csidriver.CtxExport] + "@" + vol.VolumeContext[csidriver.CtxAddress]
	dev := deviceOf(t, backend)
	before, err := kernel.Stat(dev)
	if err != nil {
		t.Fatal(err)
	}
	if servers := attachProcs(t, stateDir); len(servers) != 1 || servers[0] != before.PID {
		t.Fatalf("rblk-attach processes %v, want the one that attached %s (%d)", servers, dev, before.PID)
	}

	export := vol.VolumeContext[csidriver.CtxExport]
	written := func() float64 {
		v, _ := metricSum(scrape(t, tg.metrics), "rblkd_written_bytes_total", `export="`+export+`"`)
		return v
	}
	base := written()
	job := []string{"--name=restart", "--filename=" + filepath.Join(target, "data"), "--size=16m", "--rw=randwrite", "--bs=4k",
		"--ioengine=libaio", "--direct=1", "--iodepth=16", "--verify=crc32c", "--verify_fatal=1", "--exitall_on_error=1",
		"--verify_state_save=0"}
	fio := startFio(t, append(job, "--rate_iops=400")...)
	pollUntil(t, 2*time.Minute, "fio's writes to reach the target", func() bool { return fio.exited() || written() >= base+4<<20 })
	if fio.exited() {
		t.Fatalf("fio ended before the restart: %s", fio.r)
	}

	// The container restarts: its rblk-attach dies with it.
	killed := time.Now()
	if err := syscall.Kill(before.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	pollUntil(t, 30*time.Second, "the killed rblk-attach to be gone", func() bool { return len(attachProcs(t, stateDir)) == 0 })
	node, att := newNode()
	n, err := att.Recover(ctx)
	if err != nil || n != 1 {
		t.Fatalf("the restarted plugin adopted %d devices: %v", n, err)
	}
	adopted := time.Since(killed)
	servers := attachProcs(t, stateDir)
	if len(servers) != 1 {
		t.Fatalf("rblk-attach processes after the restart: %v, want one", servers)
	}
	// kubelet may stage it again: the same device, no second attach.
	if _, err := node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	if s := attachProcs(t, stateDir); len(s) != 1 || s[0] != servers[0] {
		t.Fatalf("rblk-attach processes after a second stage: %v, want %v", s, servers)
	}
	if d := deviceOf(t, backend); d != dev {
		t.Fatalf("the volume is %s after the restart, %s before", d, dev)
	}
	fio.wait(t)
	resumed := written()
	t.Logf("node plugin restart: rblk-attach killed under fio; adopted %s %v later; fio finished without error (%.0f MiB written in all)",
		dev, adopted.Round(time.Millisecond), (resumed-base)/(1<<20))

	// Grow it under the mounted file system.
	var sfs unix.Statfs_t
	if err := unix.Statfs(target, &sfs); err != nil {
		t.Fatal(err)
	}
	small := sfs.Blocks * uint64(sfs.Bsize)
	if _, err := ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}, VolumeCapability: mount}); err != nil {
		t.Fatal(err)
	}
	er, err := node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol.VolumeId, VolumePath: target, StagingTargetPath: staging,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}, VolumeCapability: mount})
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Statfs(target, &sfs); err != nil {
		t.Fatal(err)
	}
	if big := sfs.Blocks * uint64(sfs.Bsize); er.CapacityBytes != 128<<20 || big < small+48<<20 {
		t.Fatalf("after the expansion: device %d bytes, file system %d bytes (%d before)", er.CapacityBytes, big, small)
	}
	verify := run(t, 4*time.Minute, "fio", append(append([]string{"--output-format=json"}, job...), "--verify_only")...)
	checkFio(t, verify)

	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol.VolumeId, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if s := attachProcs(t, stateDir); len(s) != 0 {
		t.Fatalf("rblk-attach processes after NodeUnstageVolume: %v", s)
	}
	// (Another test may have taken the freed device at once: it must
	// serve this volume no more.)
	if st, err := kernel.Stat(dev); err != nil || st.Attached && st.Backend == backend {
		t.Fatalf("%s after NodeUnstageVolume: %+v, %v", dev, st, err)
	}
}

// deviceOf finds the /dev/nbdN attached with the backend identifier.
func deviceOf(t *testing.T, backend string) string {
	t.Helper()
	names, _ := filepath.Glob("/sys/block/nbd*")
	for _, name := range names {
		st, err := kernel.Stat(filepath.Base(name))
		if err == nil && st.Attached && st.Backend == backend {
			return st.Path
		}
	}
	t.Fatalf("no /dev/nbdN attached as %q", backend)
	return ""
}

// attachProcs lists the running rblk-attach processes whose arguments
// name stateDir.
func attachProcs(t *testing.T, stateDir string) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !strings.Contains(string(b), "\x00attach\x00") || !strings.Contains(string(b), stateDir) {
			continue
		}
		if stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil {
			if i := strings.LastIndexByte(string(stat), ')'); i >= 0 && i+2 < len(stat) && (stat[i+2] == 'Z' || stat[i+2] == 'X') {
				continue // (exited; its parent has not reaped it yet)
			}
		}
		pids = append(pids, pid)
	}
	return pids
}
