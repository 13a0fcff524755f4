package csidriver

import (
	"context"
	"maps"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Node is the CSI node service of one node: its host ID (the node ID the
// controller publishes volumes to) and its topology.
//
// This first cut answers what the controller side needs of a node
// (NodeGetInfo) and unpublishes, and advertises no node capability:
// staging (rblk-attach to /dev/nbdN, mkfs, mount), publishing, expansion
// and stats are not there yet, and their calls are Unimplemented.
type Node struct {
	csi.UnimplementedNodeServer
	// HostID is the node's rblk host ID: its node ID.
	HostID string
	// Topology is where the node is (the labels of the pools it can
	// reach, such as topology.rblk.io/zone).
	Topology map[string]string
}

func (n *Node) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	r := &csi.NodeGetInfoResponse{NodeId: n.HostID}
	if len(n.Topology) > 0 {
		r.AccessibleTopology = &csi.Topology{Segments: maps.Clone(n.Topology)}
	}
	return r, nil
}

func (n *Node) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{}, nil
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
	if err := unmountAndRemove(req.TargetPath); err != nil {
		return nil, status.Errorf(codes.Internal, "unpublish volume %s from %s: %v", req.VolumeId, req.TargetPath, err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}
