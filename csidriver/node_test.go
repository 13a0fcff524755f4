package csidriver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// loopAttacher stands in for rblk-attach: a volume is a sparse file on a
// loop device. It is what the node's file system work is tested on here
// (this machine has no /dev/nbdN); the guest runs the real one.
type loopAttacher struct {
	t    *testing.T
	dir  string
	size int64
	mu   sync.Mutex
	devs map[string]string
}

func (l *loopAttacher) file(id string) string {
	return filepath.Join(l.dir, strings.ReplaceAll(id, "/", "_")+".img")
}

func (l *loopAttacher) Attach(ctx context.Context, id string, _ map[string]string) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if d, ok := l.devs[id]; ok {
		return d, nil
	}
	if _, err := os.Stat(l.file(id)); err != nil {
		f, err := os.Create(l.file(id))
		if err != nil {
			return "", err
		}
		f.Truncate(l.size)
		f.Close()
	}
	out, err := exec.CommandContext(ctx, "losetup", "-f", "--show", l.file(id)).Output()
	if err != nil {
		return "", fmt.Errorf("losetup: %w", err)
	}
	d := strings.TrimSpace(string(out))
	l.devs[id] = d
	l.t.Cleanup(func() { exec.Command("losetup", "-d", d).Run() })
	return d, nil
}

func (l *loopAttacher) Detach(ctx context.Context, id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	d, ok := l.devs[id]
	if !ok {
		return nil
	}
	delete(l.devs, id)
	return exec.CommandContext(ctx, "losetup", "-d", d).Run()
}

func (l *loopAttacher) Device(id string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	d, ok := l.devs[id]
	return d, ok
}

// grow grows volume id's file and tells the loop device (as a target's
// online grow reaches /dev/nbdN).
func (l *loopAttacher) grow(id string, size int64) {
	if err := os.Truncate(l.file(id), size); err != nil {
		l.t.Fatal(err)
	}
	d, _ := l.Device(id)
	if out, err := exec.Command("losetup", "-c", d).CombinedOutput(); err != nil {
		l.t.Fatalf("losetup -c: %v: %s", err, out)
	}
}

func needRootAndTools(t *testing.T, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("loop devices and mounts: root only")
	}
	for _, tool := range append(tools, "losetup", "blkid", "mount") {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is missing (the test command installs it): %v", tool, err)
		}
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		t.Fatalf("no loop devices: %v", err)
	}
}

// hasCap reports whether this process has capability c in effect.
func hasCap(c int) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			var mask uint64
			fmt.Sscanf(strings.TrimSpace(v), "%x", &mask)
			return mask&(1<<c) != 0
		}
	}
	return false
}

func mountCap(fs string) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
}

func blockCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
}

// TestNodeFileSystem stages, publishes, writes, grows, unpublishes,
// unstages and stages again a volume with each file system, every call
// twice (idempotence), and checks the file written survives.
func TestNodeFileSystem(t *testing.T) {
	for _, c := range []struct {
		fs         string
		size, grow int64
		tools      []string
	}{
		{"ext4", 64 << 20, 128 << 20, []string{"mkfs.ext4", "resize2fs"}},
		{"xfs", 320 << 20, 512 << 20, []string{"mkfs.xfs", "xfs_growfs"}},
	} {
		t.Run(c.fs, func(t *testing.T) {
			needRootAndTools(t, c.tools...)
			dir := t.TempDir()
			la := &loopAttacher{t: t, dir: dir, size: c.size, devs: map[string]string{}}
			n := &Node{HostID: "node-1", Attacher: la}
			ctx := context.Background()
			id := "storage-1/fast/pvc-" + c.fs
			staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "pods", "p1", "mount")
			t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH); unix.Unmount(staging, unix.MNT_DETACH) })
			stage := &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap(c.fs)}
			publish := &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: mountCap(c.fs)}
			for range 2 {
				if _, err := n.NodeStageVolume(ctx, stage); err != nil {
					t.Fatal(err)
				}
			}
			dev, _ := la.Device(id)
			if fs, err := deviceFS(ctx, dev); err != nil || fs != c.fs {
				t.Fatalf("the device holds %q (%v), want %s", fs, err, c.fs)
			}
			for range 2 {
				if _, err := n.NodePublishVolume(ctx, publish); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(filepath.Join(target, "hello"), []byte("from the pod"), 0o644); err != nil {
				t.Fatal(err)
			}
			st, err := n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
			if err != nil || len(st.Usage) != 2 || st.Usage[0].Total <= 0 || st.Usage[0].Used <= 0 {
				t.Fatalf("stats: %v, %v", st, err)
			}
			before := st.Usage[0].Total
			if h, err := n.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id}); err != nil || len(h.VolumeHealth.HealthStatuses) != 0 {
				t.Fatalf("health of an attached volume: %v, %v", h, err)
			}
			// An online grow of the volume, then of its file system.
			// (ext4's online resize needs CAP_SYS_RESOURCE, which some
			// sandboxes take away even from root.)
			if c.fs != "ext4" || hasCap(unix.CAP_SYS_RESOURCE) {
				la.grow(id, c.grow)
				er, err := n.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target, VolumeCapability: mountCap(c.fs)})
				if err != nil || er.CapacityBytes != c.grow {
					t.Fatalf("expand: %v, %v; want %d bytes", er, err, c.grow)
				}
				st, _ = n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
				if st.Usage[0].Total <= before {
					t.Fatalf("the file system did not grow: %d bytes, %d before", st.Usage[0].Total, before)
				}
			} else {
				t.Log("no CAP_SYS_RESOURCE here: ext4's online grow is not tried (xfs's is)")
			}
			for range 2 {
				if _, err := n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
					t.Fatal(err)
				}
				if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
					t.Fatal(err)
				}
			}
			if m, _ := mounted(staging); m {
				t.Fatal("still mounted after unstage")
			}
			if h, _ := n.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id}); len(h.VolumeHealth.HealthStatuses) != 1 ||
				h.VolumeHealth.HealthStatuses[0].Status != csi.VolumeHealthErrorType_INACCESSIBLE {
				t.Fatalf("health of a detached volume: %v", h)
			}
			// Staged again: the file system is kept, not made anew.
			if _, err := n.NodeStageVolume(ctx, stage); err != nil {
				t.Fatal(err)
			}
			if _, err := n.NodePublishVolume(ctx, publish); err != nil {
				t.Fatal(err)
			}
			if b, err := os.ReadFile(filepath.Join(target, "hello")); err != nil || string(b) != "from the pod" {
				t.Fatalf("the file after a second stage: %q, %v", b, err)
			}
			// Another file system asked of it: refused, not formatted over.
			n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
			n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			other := "xfs"
			if c.fs == "xfs" {
				other = "ext4"
			}
			_, err = n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap(other)})
			if status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("stage as %s a volume holding %s: %v, want FailedPrecondition", other, c.fs, err)
			}
			n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		})
	}
}

// TestNodeBlock publishes a block volume: the target path is the device.
func TestNodeBlock(t *testing.T) {
	needRootAndTools(t)
	dir := t.TempDir()
	la := &loopAttacher{t: t, dir: dir, size: 16 << 20, devs: map[string]string{}}
	n := &Node{HostID: "node-1", Attacher: la}
	ctx := context.Background()
	id := "storage-1/fast/pvc-block"
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "pods", "p1", "dev")
	t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
	if _, err := n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: blockCap()}); err != nil {
		t.Fatal(err)
	}
	pub := &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: blockCap()}
	for range 2 {
		if _, err := n.NodePublishVolume(ctx, pub); err != nil {
			t.Fatal(err)
		}
	}
	st, err := os.Stat(target)
	if err != nil || st.Mode()&os.ModeDevice == 0 {
		t.Fatalf("the target path: %v, %v; want the block device", st, err)
	}
	if fs, _ := deviceFS(ctx, target); fs != "" {
		t.Fatalf("a block volume got a file system: %s", fs)
	}
	if _, err := n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	if _, ok := la.Device(id); ok {
		t.Fatal("still attached after unstage")
	}
}

// conditionAttacher is attached, with the condition it is given.
type conditionAttacher struct{ reason, msg string }

func (c conditionAttacher) Attach(context.Context, string, map[string]string) (string, error) {
	return "/dev/null", nil
}
func (c conditionAttacher) Detach(context.Context, string) error { return nil }
func (c conditionAttacher) Device(string) (string, bool)         { return "/dev/null", true }
func (c conditionAttacher) Condition(string) (Condition, bool) {
	return Condition{csi.VolumeHealthErrorType_INACCESSIBLE, c.reason, c.msg}, c.reason != ""
}

// NodeGetVolumeHealth passes on what a Conditioner says of an attach that
// runs, as INACCESSIBLE, and nothing when it says nothing.
func TestNodeVolumeHealthCondition(t *testing.T) {
	ctx := context.Background()
	for _, c := range []conditionAttacher{{}, {"Reconnecting", "the target is unreachable"}} {
		n := &Node{HostID: "n1", Attacher: c}
		h, err := n.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "t/p/v"})
		if err != nil {
			t.Fatal(err)
		}
		got := h.VolumeHealth.HealthStatuses
		switch {
		case c.reason == "" && len(got) != 0:
			t.Errorf("no condition: %v", got)
		case c.reason != "" && (len(got) != 1 || got[0].Status != csi.VolumeHealthErrorType_INACCESSIBLE || got[0].Reason != c.reason || got[0].Message != c.msg):
			t.Errorf("condition %q: %v", c.reason, got)
		}
	}
}
