package e2e

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/csidriver"
	"github.com/rblk/rblk/mirror"
)

// TestCSIMirror: a volume of a StorageClass of replicas: 2, as Kubernetes
// drives rblk-csi, over two rblkd in two zones.
//
// CreateVolume places a copy in each zone. The node service (in this
// process, as rblk-csi --mode node runs it) stages it as an md RAID1 over
// two /dev/nbdN with ext4 on it and publishes it; fio writes a file there
// with crc32c in every block. One copy's rblkd is killed (SIGKILL): fio
// sees no error, NodeGetVolumeHealth says DEGRADED (Degraded) within the
// fast-fail time (SIGKILL) or the keepalive (SIGSTOP), and
// rblk_mirror_degraded is 1. The rblkd runs again: the member is put back
// (from the bitmap after SIGSTOP: rblk_mirror_members_added_total
// from="bitmap"; in full after SIGKILL if the target lost writes), the
// volume is healthy again, md's check finds no mismatch. Then
// ControllerExpandVolume grows both copies (32 to 64 MiB; 16 to 32 under
// emulation) and NodeExpandVolume the array and the file system, under
// the mount; the file verifies. Unstage stops the array and detaches both
// copies; DeleteVolume deletes both.
func TestCSIMirror(t *testing.T) {
	t.Parallel()
	if e2e.device != "nbd" {
		notApplicable(t, "the mirror is an md RAID1 over the kernel's /dev/nbdN (RBLK_E2E_DEVICE=nbd)")
	}
	needTools(t, "mdadm", "fio", "mkfs.ext4", "resize2fs", "blkid")
	if out, err := exec.Command("modprobe", "raid1").CombinedOutput(); err != nil {
		skipOrFail(t, "modprobe raid1: %v: %s", err, out)
	}
	authFile, secretA, _ := authFiles(t)
	storage, ctrl, dir := csiTargets(t, authFile, "zone-a", "zone-b")
	ctx, cancel := context.WithTimeout(context.Background(), patient(8*time.Minute))
	defer cancel()
	// Each drill waits for md to copy a whole member through rblk, which
	// the emulated guest does at about 170 KB/s: there the copies are half
	// the size (16 MiB, grown to 32) and fio writes 4 MiB, not 8.
	size, grown, fioSize := int64(32<<20), int64(64<<20), "8m"
	if emulated() {
		size, grown, fioSize = 16<<20, 32<<20, "4m"
	}

	mount := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	cr, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-mirror", Parameters: map[string]string{csidriver.ParamReplicas: "2"},
		CapacityRange: &csi.CapacityRange{RequiredBytes: size}, VolumeCapabilities: []*csi.VolumeCapability{mount}})
	if err != nil {
		t.Fatal(err)
	}
	vol := cr.Volume
	if !strings.HasPrefix(vol.VolumeId, "storage-1/fast/storage-2/fast/") || len(vol.AccessibleTopology) != 2 {
		t.Fatalf("volume %s, reachable from %v: want a copy on each target, reachable from both zones", vol.VolumeId, vol.AccessibleTopology)
	}
	pr, err := ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol.VolumeId, NodeId: "host-a", VolumeCapability: mount})
	if err != nil {
		t.Fatal(err)
	}

	const fastFail = 2 * time.Second
	metrics := mirror.NewMetrics()
	mirrors := &csidriver.MirrorAttacher{
		A: &csidriver.RBLKAttacher{Bin: attachBin, HostID: "host-a", SecretFile: secretA, StateDir: filepath.Join(dir, "csi-state")},
		MirrorArgs: []string{"--fast-fail-timeout=" + fastFail.String(), "--keepalive-timeout=5s", "--restart-grace=60s",
			"--reconnect-timeout=10m", "--fail-on-lost-writes"},
		Every: 200 * time.Millisecond, Metrics: metrics, Logger: zaptest.NewLogger(t)}
	defer mirrors.Close()
	node := &csidriver.Node{HostID: "host-a", Attacher: mirrors, DefaultFS: "ext4", Logger: zaptest.NewLogger(t)}
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: staging, VolumeCapability: mount,
		VolumeContext: vol.VolumeContext, PublishContext: pr.PublishContext}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: mount, VolumeContext: vol.VolumeContext, PublishContext: pr.PublishContext}); err != nil {
		t.Fatal(err)
	}
	unstaged := false
	t.Cleanup(func() {
		if !unstaged {
			unix.Unmount(target, unix.MNT_DETACH)
			unix.Unmount(staging, unix.MNT_DETACH)
			dctx, cancel := context.WithTimeout(context.Background(), patient(time.Minute))
			defer cancel()
			mirrors.Detach(dctx, vol.VolumeId)
		}
	})
	health := func() *csi.VolumeHealth_VolumeHealthEntry {
		h, err := node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: vol.VolumeId})
		if err != nil {
			t.Fatal(err)
		}
		if s := h.VolumeHealth.HealthStatuses; len(s) > 0 {
			return s[0]
		}
		return nil
	}
	if h := health(); h != nil {
		t.Fatalf("a new mirror's health: %v", h)
	}
	gauge := func(name, want string) error {
		return testutil.CollectAndCompare(metrics, strings.NewReader(want), name)
	}

	file := filepath.Join(target, "data")
	job := []string{"--name=csimirror", "--filename=" + file, "--size=" + fioSize, "--rw=randwrite", "--bs=4k", "--ioengine=libaio",
		"--direct=1", "--iodepth=8", "--verify=crc32c", "--verify_fatal=1", "--exitall_on_error=1", "--verify_state_save=0"}
	written := func() float64 {
		v, _ := metricSum(scrapeQuiet(storage[1].tg.metrics), "rblkd_written_bytes_total")
		return v
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics)
	added := func(from string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "rblk_mirror_members_added_total" {
				continue
			}
			for _, m := range mf.Metric {
				for _, l := range m.Label {
					if l.GetName() == "from" && l.GetValue() == from {
						return m.GetCounter().GetValue()
					}
				}
			}
		}
		return 0
	}
	o := mirror.Options{Name: "pvc-mirror"}
	mdFastResync(t, o)

	// SIGSTOP (a target that hangs) past the keepalive, then SIGCONT: the
	// same instance comes back, and md copies what changed (the bitmap).
	// SIGKILL, then a restart: a copy whose target lost acknowledged
	// writes is attached again and copied in full; one that lost none
	// is re-added from the bitmap.
	for i, fault := range []string{"SIGSTOP", "SIGKILL"} {
		fio := startFio(t, append(job, "--rate_iops=200")...)
		base := written()
		pollUntil(t, 2*time.Minute, "fio's writes to reach the second copy", func() bool { return fio.exited() || written() >= base+1<<20 })
		p := storage[1].tg.cmd.Process
		if fault == "SIGSTOP" {
			if err := p.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Signal(syscall.SIGCONT) })
		} else {
			storage[1].tg.kill9(t)
		}
		faulted := time.Now()
		pollUntil(t, time.Minute, "NodeGetVolumeHealth to say DEGRADED", func() bool {
			h := health()
			return h != nil && h.Status == csi.VolumeHealthErrorType_DEGRADED && h.Reason == "Degraded"
		})
		degrade := time.Since(faulted)
		if err := gauge("rblk_mirror_degraded", "# HELP rblk_mirror_degraded Members the array lacks: missing or failed (0: both copies serve).\n"+
			"# TYPE rblk_mirror_degraded gauge\nrblk_mirror_degraded{array=\"pvc-mirror\"} 1\n"); err != nil {
			t.Error(err)
		}
		t.Logf("%s: %s", fault, health().Message)
		if fault == "SIGSTOP" {
			if err := p.Signal(syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
		} else {
			storage[1].restart(t, authFile)
		}
		back := time.Now()
		sawResync := false
		pollUntil(t, 5*time.Minute, "the volume healthy again", func() bool {
			h := health()
			if h != nil && h.Reason == "Resyncing" {
				sawResync = true
			}
			return h == nil
		})
		resync := time.Since(back)
		fio.wait(t)
		bitmap, full := added("bitmap"), added("full")
		t.Logf("%s of one copy's rblkd under fio: DEGRADED %v after it (fast-fail time %v, keepalive 5s); healthy again %v after its rblkd ran again (Resyncing seen: %v); members added so far: %v from the bitmap, %v in full",
			fault, degrade.Round(100*time.Millisecond), fastFail, resync.Round(100*time.Millisecond), sawResync, bitmap, full)
		switch {
		case fault == "SIGSTOP" && (bitmap != 1 || full != 0):
			t.Fatalf("after SIGSTOP: %v members added from the bitmap, %v in full; want the one from the bitmap", bitmap, full)
		case bitmap+full != float64(i+1):
			t.Fatalf("after %s: %v members added in all; want %d", fault, bitmap+full, i+1)
		}
		if n := mdCheck(t, o); n != 0 {
			t.Fatalf("after %s: md's check found %d mismatched sectors", fault, n)
		}
	}

	// Grow it under the mounted file system.
	var before unix.Statfs_t
	if err := unix.Statfs(target, &before); err != nil {
		t.Fatal(err)
	}
	er, err := ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: vol.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: grown}, VolumeCapability: mount})
	if err != nil {
		t.Fatal(err)
	}
	if !er.NodeExpansionRequired || er.CapacityBytes != grown {
		t.Fatalf("ControllerExpandVolume: %v", er)
	}
	nr, err := node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: vol.VolumeId, VolumePath: target, StagingTargetPath: staging,
		CapacityRange: &csi.CapacityRange{RequiredBytes: grown}, VolumeCapability: mount})
	if err != nil {
		t.Fatal(err)
	}
	var after unix.Statfs_t
	if err := unix.Statfs(target, &after); err != nil {
		t.Fatal(err)
	}
	if nr.CapacityBytes < grown || after.Blocks*uint64(after.Bsize) < before.Blocks*uint64(before.Bsize)+uint64(grown-size)*3/4 {
		t.Fatalf("after the growth: array %d bytes, file system %d bytes (was %d)", nr.CapacityBytes, after.Blocks*uint64(after.Bsize), before.Blocks*uint64(before.Bsize))
	}
	checkFio(t, run(t, 4*time.Minute, "fio", append(append([]string{"--output-format=json"}, job...), "--verify_only")...))
	if n := mdCheck(t, o); n != 0 {
		t.Fatalf("after the growth, md's check found %d mismatched sectors", n)
	}

	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: vol.VolumeId, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: vol.VolumeId, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	unstaged = true
	if _, err := mirror.Stat(o); err == nil {
		t.Error("the array is still up after NodeUnstageVolume")
	}
	if _, ok := mirrors.A.Device(vol.VolumeId + "#0"); ok {
		t.Error("a copy is still attached after NodeUnstageVolume")
	}
	if _, err := ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol.VolumeId, NodeId: "host-a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.VolumeId}); err != nil {
		t.Fatal(err)
	}
	lr, err := ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(lr.Entries) != 0 {
		t.Fatalf("after DeleteVolume: %v, %v", lr, err)
	}
}
