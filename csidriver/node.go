package csidriver

import (
	"context"
	"fmt"
	"maps"
	"os"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Node is the CSI node service of one node: its host ID (the node ID the
// controller publishes volumes to), its topology, and the Attacher that
// makes volumes its block devices.
//
// NodeStageVolume attaches the volume and, for a file system, makes one
// when the device has none (ext4 or xfs) and mounts it at the staging
// path; NodePublishVolume bind-mounts the staging path (or, for a block
// volume, the device) at the target path; the un- calls undo them and
// work when the target is gone. Each call is idempotent, and the calls of
// one volume run one at a time.
type Node struct {
	csi.UnimplementedNodeServer
	// HostID is the node's rblk host ID: its node ID.
	HostID string
	// Topology is where the node is (the labels of the pools it can
	// reach, such as topology.rblk.io/zone).
	Topology map[string]string
	// Attacher attaches volumes. Nil: the node attaches nothing (its
	// stage calls fail), as in the controller tests.
	Attacher Attacher
	// DefaultFS is the file system made where the capability names none:
	// ext4 (the default) or xfs.
	DefaultFS string
	// Logger: what was done. Default: none.
	Logger *zap.Logger

	locksMu sync.Mutex
	locks   map[string]*sync.Mutex
}

func (n *Node) log() *zap.Logger {
	if n.Logger == nil {
		return zap.NewNop()
	}
	return n.Logger
}

// lock serializes the calls of one volume.
func (n *Node) lock(id string) func() {
	n.locksMu.Lock()
	if n.locks == nil {
		n.locks = map[string]*sync.Mutex{}
	}
	m := n.locks[id]
	if m == nil {
		m = &sync.Mutex{}
		n.locks[id] = m
	}
	n.locksMu.Unlock()
	m.Lock()
	return m.Unlock
}

func (n *Node) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	r := &csi.NodeGetInfoResponse{NodeId: n.HostID}
	if len(n.Topology) > 0 {
		r.AccessibleTopology = &csi.Topology{Segments: maps.Clone(n.Topology)}
	}
	return r, nil
}

func (n *Node) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	if n.Attacher == nil {
		return &csi.NodeGetCapabilitiesResponse{}, nil
	}
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

// fsType is the file system a mount capability asks for.
func (n *Node) fsType(c *csi.VolumeCapability) string {
	if t := c.GetMount().GetFsType(); t != "" {
		return t
	}
	if n.DefaultFS != "" {
		return n.DefaultFS
	}
	return "ext4"
}

func (n *Node) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	switch {
	case req.VolumeId == "":
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	case req.StagingTargetPath == "":
		return nil, status.Error(codes.InvalidArgument, "no staging path")
	case req.VolumeCapability == nil:
		return nil, status.Error(codes.InvalidArgument, "no volume capability")
	case n.Attacher == nil:
		return nil, status.Error(codes.FailedPrecondition, "this node attaches no volumes (no rblk-attach)")
	}
	if err := checkCapabilities([]*csi.VolumeCapability{req.VolumeCapability}, true); err != nil {
		return nil, err
	}
	defer n.lock(req.VolumeId)()
	dev, err := n.Attacher.Attach(ctx, req.VolumeId, req.VolumeContext)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "attach volume %s: %v", req.VolumeId, err)
	}
	if req.VolumeCapability.GetBlock() != nil {
		n.log().Info("volume staged", zap.String("volume_id", req.VolumeId), zap.String("device", dev))
		return &csi.NodeStageVolumeResponse{}, nil
	}
	if m, err := mounted(req.StagingTargetPath); err != nil {
		return nil, status.Errorf(codes.Internal, "stage volume %s: %v", req.VolumeId, err)
	} else if m {
		return &csi.NodeStageVolumeResponse{}, nil
	}
	fs := n.fsType(req.VolumeCapability)
	have, err := deviceFS(ctx, dev)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "stage volume %s: %v", req.VolumeId, err)
	}
	switch {
	case have == "":
		if err := mkfs(ctx, fs, dev); err != nil {
			return nil, status.Errorf(codes.Internal, "stage volume %s: %v", req.VolumeId, err)
		}
		n.log().Info("file system made", zap.String("volume_id", req.VolumeId), zap.String("device", dev), zap.String("fs", fs))
	case have != fs:
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s holds a %s file system, not the %s asked for: not formatted over", req.VolumeId, have, fs)
	}
	if err := os.MkdirAll(req.StagingTargetPath, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "stage volume %s: %v", req.VolumeId, err)
	}
	if err := mountFS(dev, req.StagingTargetPath, fs, req.VolumeCapability.GetMount().GetMountFlags()); err != nil {
		return nil, status.Errorf(codes.Internal, "stage volume %s: %v", req.VolumeId, err)
	}
	n.log().Info("volume staged", zap.String("volume_id", req.VolumeId), zap.String("device", dev), zap.String("path", req.StagingTargetPath))
	return &csi.NodeStageVolumeResponse{}, nil
}

func (n *Node) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	switch {
	case req.VolumeId == "":
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	case req.StagingTargetPath == "":
		return nil, status.Error(codes.InvalidArgument, "no staging path")
	}
	defer n.lock(req.VolumeId)()
	if err := unmountAll(req.StagingTargetPath); err != nil {
		return nil, status.Errorf(codes.Internal, "unstage volume %s: %v", req.VolumeId, err)
	}
	if n.Attacher != nil {
		if err := n.Attacher.Detach(ctx, req.VolumeId); err != nil {
			return nil, status.Errorf(codes.Internal, "detach volume %s: %v", req.VolumeId, err)
		}
	}
	n.log().Info("volume unstaged", zap.String("volume_id", req.VolumeId))
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (n *Node) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	switch {
	case req.VolumeId == "":
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	case req.TargetPath == "":
		return nil, status.Error(codes.InvalidArgument, "no target path")
	case req.VolumeCapability == nil:
		return nil, status.Error(codes.InvalidArgument, "no volume capability")
	case req.StagingTargetPath == "":
		return nil, status.Error(codes.FailedPrecondition, "no staging path: the volume is staged first")
	case n.Attacher == nil:
		return nil, status.Error(codes.FailedPrecondition, "this node attaches no volumes (no rblk-attach)")
	}
	defer n.lock(req.VolumeId)()
	if m, err := mounted(req.TargetPath); err != nil {
		return nil, status.Errorf(codes.Internal, "publish volume %s: %v", req.VolumeId, err)
	} else if m {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	var src string
	if req.VolumeCapability.GetBlock() != nil {
		dev, ok := n.Attacher.Device(req.VolumeId)
		if !ok {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged on this node", req.VolumeId)
		}
		src = dev
		if err := touch(req.TargetPath); err != nil {
			return nil, status.Errorf(codes.Internal, "publish volume %s: %v", req.VolumeId, err)
		}
	} else {
		if m, err := mounted(req.StagingTargetPath); err != nil || !m {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged at %s", req.VolumeId, req.StagingTargetPath)
		}
		src = req.StagingTargetPath
		if err := os.MkdirAll(req.TargetPath, 0o750); err != nil {
			return nil, status.Errorf(codes.Internal, "publish volume %s: %v", req.VolumeId, err)
		}
	}
	if err := bindMount(src, req.TargetPath, req.Readonly); err != nil {
		return nil, status.Errorf(codes.Internal, "publish volume %s: %v", req.VolumeId, err)
	}
	n.log().Info("volume published", zap.String("volume_id", req.VolumeId), zap.String("path", req.TargetPath), zap.Bool("read_only", req.Readonly))
	return &csi.NodePublishVolumeResponse{}, nil
}

// NodeUnpublishVolume unmounts the target path, if it is mounted, and
// removes it: a path not there (never published, or unpublished before)
// is no error.
func (n *Node) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	if req.TargetPath == "" {
		return nil, status.Error(codes.InvalidArgument, "no target path")
	}
	defer n.lock(req.VolumeId)()
	if err := unmountAndRemove(req.TargetPath); err != nil {
		return nil, status.Errorf(codes.Internal, "unpublish volume %s from %s: %v", req.VolumeId, req.TargetPath, err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (n *Node) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	switch {
	case req.VolumeId == "":
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	case req.VolumePath == "":
		return nil, status.Error(codes.InvalidArgument, "no volume path")
	case n.Attacher == nil:
		return nil, status.Error(codes.FailedPrecondition, "this node attaches no volumes (no rblk-attach)")
	}
	defer n.lock(req.VolumeId)()
	dev, ok := n.Attacher.Device(req.VolumeId)
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s is not attached on this node", req.VolumeId)
	}
	var err error
	want := req.GetCapacityRange().GetRequiredBytes()
	var size int64
	if g, ok := n.Attacher.(Grower); ok {
		size, err = g.Grow(ctx, req.VolumeId, want)
	} else {
		size, err = waitDeviceSize(ctx, dev, want)
	}
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "expand volume %s: %v", req.VolumeId, err)
	}
	st, err := os.Stat(req.VolumePath)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "volume path %s: %v", req.VolumePath, err)
	}
	if req.VolumeCapability.GetBlock() != nil || !st.IsDir() {
		return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil // (a block volume: no file system to grow)
	}
	fs, err := deviceFS(ctx, dev)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "expand volume %s: %v", req.VolumeId, err)
	}
	if err := growFS(ctx, fs, dev, req.VolumePath); err != nil {
		return nil, status.Errorf(codes.Internal, "expand volume %s: %v", req.VolumeId, err)
	}
	n.log().Info("file system grown", zap.String("volume_id", req.VolumeId), zap.String("device", dev), zap.Int64("bytes", size))
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

func (n *Node) NodeGetVolumeStats(_ context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	switch {
	case req.VolumeId == "":
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	case req.VolumePath == "":
		return nil, status.Error(codes.InvalidArgument, "no volume path")
	}
	st, err := os.Stat(req.VolumePath)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "volume path %s: %v", req.VolumePath, err)
	}
	if !st.IsDir() { // a block volume
		r := &csi.NodeGetVolumeStatsResponse{}
		if n.Attacher != nil {
			if dev, ok := n.Attacher.Device(req.VolumeId); ok {
				if size, err := deviceSize(dev); err == nil {
					r.Usage = []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}
				}
			}
		}
		return r, nil
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(req.VolumePath, &sfs); err != nil {
		return nil, status.Errorf(codes.Internal, "statfs %s: %v", req.VolumePath, err)
	}
	bs := sfs.Bsize
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(sfs.Blocks) * bs, Available: int64(sfs.Bavail) * bs, Used: int64(sfs.Blocks-sfs.Bfree) * bs},
		{Unit: csi.VolumeUsage_INODES, Total: int64(sfs.Files), Available: int64(sfs.Ffree), Used: int64(sfs.Files - sfs.Ffree)},
	}}, nil
}

// NodeGetVolumeHealth reports a volume whose attach is not running, or
// whose device is gone, as INACCESSIBLE (what CSI 1.13 has in place of
// the volume condition of NodeGetVolumeStats); and what its Attacher, a
// Conditioner, says: INACCESSIBLE while its attach waits for its target
// (Reconnecting) or lost it (Failed), DEGRADED while a mirror lacks a
// copy (Degraded) or copies onto one (Resyncing).
func (n *Node) NodeGetVolumeHealth(_ context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	h := &csi.VolumeHealth{VolumeId: req.VolumeId}
	if n.Attacher == nil {
		return nil, status.Error(codes.FailedPrecondition, "this node attaches no volumes (no rblk-attach)")
	}
	if _, ok := n.Attacher.Device(req.VolumeId); !ok {
		h.HealthStatuses = []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "NotAttached",
			Message: "the volume's rblk-attach is not running on this node, or its device is gone"}}
	} else if c, ok := n.Attacher.(Conditioner); ok {
		if cond, bad := c.Condition(req.VolumeId); bad {
			h.HealthStatuses = []*csi.VolumeHealth_VolumeHealthEntry{{Status: cond.Health, Reason: cond.Reason, Message: cond.Message}}
		}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: h}, nil
}

// devSize is deviceSize; tests replace it.
var devSize = deviceSize

// How long NodeExpandVolume waits for the device to show the grown
// volume; a variable for tests.
var growWait = 30 * time.Second

// waitDeviceSize returns dev's size once it is at least want bytes: the
// target tells rblk-attach of an online growth, which resizes the device,
// a moment after ControllerExpandVolume returns. It waits up to growWait
// (or ctx), then fails: the caller retries.
func waitDeviceSize(ctx context.Context, dev string, want int64) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, growWait)
	defer cancel()
	for {
		size, err := devSize(dev)
		if err != nil || size >= want {
			return size, err
		}
		select {
		case <-ctx.Done():
			return size, fmt.Errorf("%s has %d bytes, the volume %d: its attach has not resized it yet", dev, size, want)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
