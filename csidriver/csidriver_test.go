package csidriver

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rblk/rblk/pool"
)

func TestVolumeID(t *testing.T) {
	for _, c := range []struct {
		in string
		ok bool
	}{
		{"storage-1/fast/pvc-1", true},
		{"s-a/fast/s-b/slow/pvc-1", true},
		{"s-b/fast/s-a/slow/pvc-1", false}, // (not in the targets' order)
		{"s-a/fast/s-a/slow/pvc-1", false}, // (one target)
		{"s-a/fast/s-b/pvc-1", false},
		{"storage-1/fast/pvc-1/x", false},
		{"storage-1/fast", false},
		{"Storage/fast/pvc", false},
		{"s/fast/../x", false},
		{"s/fast/..", false},
		{"fake-vol-id-1234", false},
		{"", false},
	} {
		id, err := parseVolumeID(c.in)
		if (err == nil) != c.ok {
			t.Errorf("parseVolumeID(%q) = %v, %v; want ok %v", c.in, id, err, c.ok)
		}
		if err == nil && id.String() != c.in {
			t.Errorf("parseVolumeID(%q).String() = %q", c.in, id.String())
		}
	}
}

func TestVolumeName(t *testing.T) {
	if got := volumeName("pvc-0b7c1f0e"); got != "pvc-0b7c1f0e" {
		t.Errorf("a name a pool takes: %q", got)
	}
	for _, n := range []string{"a/b", "..", "with space", strings.Repeat("x", 300), "ünïcode"} {
		got := volumeName(n)
		if pool.CheckName(got) != nil {
			t.Errorf("volumeName(%q) = %q: not a pool's name", n, got)
		}
		if got != volumeName(n) {
			t.Errorf("volumeName(%q) is not stable", n)
		}
	}
	if volumeName("a/b") == volumeName("a/c") {
		t.Error("two names map to one volume")
	}
}

func TestSize(t *testing.T) {
	for _, c := range []struct {
		req, limit, want int64
		code             codes.Code
	}{
		{0, 0, DefaultVolumeSize, codes.OK},
		{1, 0, 1 << 20, codes.OK},
		{1 << 20, 0, 1 << 20, codes.OK},
		{(1 << 20) + 1, 0, 2 << 20, codes.OK},
		{5000, 8192, 8192, codes.OK},      // a MiB would pass the limit: 4 KiB units
		{0, 64 << 20, 64 << 20, codes.OK}, // no size, a limit below the default
		{5000, 5000, 0, codes.OutOfRange}, // no 4 KiB multiple fits
		{-1, 0, 0, codes.InvalidArgument},
	} {
		got, err := size(&csi.CapacityRange{RequiredBytes: c.req, LimitBytes: c.limit})
		if status.Code(err) != c.code || got != c.want {
			t.Errorf("size(%d, %d) = %d, %v; want %d, %s", c.req, c.limit, got, err, c.want, c.code)
		}
	}
}

func TestTopology(t *testing.T) {
	labels := map[string]string{"topology.rblk.io/zone": "a", "topology.rblk.io/fabric": "roce-1"}
	seg := func(kv ...string) *csi.Topology {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return &csi.Topology{Segments: m}
	}
	for _, c := range []struct {
		name string
		req  *csi.TopologyRequirement
		ok   bool
		rank int
	}{
		{"none", nil, true, 0},
		{"requisite matches", &csi.TopologyRequirement{Requisite: []*csi.Topology{seg("topology.rblk.io/zone", "b"), seg("topology.rblk.io/zone", "a")}}, true, 0},
		{"requisite does not", &csi.TopologyRequirement{Requisite: []*csi.Topology{seg("topology.rblk.io/zone", "b")}}, false, 0},
		{"a key the pool lacks", &csi.TopologyRequirement{Requisite: []*csi.Topology{seg("topology.kubernetes.io/hostname", "n1")}}, false, 0},
		{"preferred second", &csi.TopologyRequirement{Preferred: []*csi.Topology{seg("topology.rblk.io/zone", "b"), seg("topology.rblk.io/fabric", "roce-1")}}, true, 1},
	} {
		ok, rank := allowed(labels, c.req)
		if ok != c.ok || (ok && rank != c.rank) {
			t.Errorf("%s: allowed = %v, %d; want %v, %d", c.name, ok, rank, c.ok, c.rank)
		}
	}
}

func TestCheckCapabilities(t *testing.T) {
	mount := func(fs string, m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
		return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: m}}
	}
	block := func(m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
		return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: m}}
	}
	for _, c := range []struct {
		name   string
		cap    *csi.VolumeCapability
		shared bool
		ok     bool
	}{
		{"ext4 single writer", mount("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), false, true},
		{"xfs many readers", mount("xfs", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY), false, true},
		{"btrfs", mount("btrfs", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), false, false},
		{"ext4 many writers, even shared", mount("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), true, false},
		{"block many writers, shared", block(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), true, true},
		{"block many writers, not shared", block(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), false, false},
		{"no access mode", &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}, false, false},
	} {
		err := checkCapabilities([]*csi.VolumeCapability{c.cap}, c.shared)
		if (err == nil) != c.ok {
			t.Errorf("%s: %v, want ok %v", c.name, err, c.ok)
		}
	}
	if checkCapabilities(nil, false) == nil {
		t.Error("no capabilities accepted")
	}
}

func TestMountinfo(t *testing.T) {
	line := `36 35 98:0 /mnt1 /var/lib/kubelet/pods/x/volumes/with\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
	if got := mountPoint(line); got != "/var/lib/kubelet/pods/x/volumes/with space" {
		t.Errorf("mountPoint = %q", got)
	}
	if got := mountPoint("short line"); got != "" {
		t.Errorf("mountPoint of a short line = %q", got)
	}
}

// TestNodeUnpublish: a mounted target path is unmounted and removed; a
// second call, and one for a path never there, succeed.
func TestNodeUnpublish(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounts a tmpfs: root only")
	}
	dir := filepath.Join(t.TempDir(), "target")
	if err := os.Mkdir(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	n := &Node{HostID: "n"}
	req := &csi.NodeUnpublishVolumeRequest{VolumeId: "t/p/v", TargetPath: dir}
	for i := range 2 {
		if _, err := n.NodeUnpublishVolume(context.Background(), req); err != nil {
			t.Fatalf("call %d: %v", i+1, err)
		}
		if m, _ := mounted(dir); m {
			t.Fatalf("call %d: still mounted", i+1)
		}
		if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("call %d: the target path is left: %v", i+1, err)
		}
	}
	if _, err := n.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: "t/p/v"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("no target path: %v, want InvalidArgument", err)
	}
}
