package csidriver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rblk/rblk/manage/managepb"
)

// Volume sizes.
const (
	// DefaultVolumeSize is the size of a volume asked for without one.
	DefaultVolumeSize = 1 << 30
	// sizeUnit is what sizes are rounded up to where the limit allows.
	sizeUnit = 1 << 20
	// blockUnit is what sizes are always rounded up to.
	blockUnit = 4096
)

// Keys of a volume's context (what NodeStageVolume gets).
const (
	CtxTarget    = "rblk.io/target"
	CtxAddress   = "rblk.io/address"
	CtxTransport = "rblk.io/transport"
	CtxExport    = "rblk.io/export"
)

// StorageClass parameters.
const (
	// ParamPool picks the pool (default: the one with the most room
	// that the topology allows).
	ParamPool = "pool"
	// ParamShared "true": several nodes may write at once (block volumes
	// of MULTI_NODE_MULTI_WRITER, for cluster file systems).
	ParamShared = "shared"
)

// Controller is the CSI controller service.
type Controller struct {
	csi.UnimplementedControllerServer
	inv *Inventory
	log *zap.Logger
}

// NewController serves inv's targets.
func NewController(inv *Inventory, log *zap.Logger) *Controller {
	if log == nil {
		log = zap.NewNop()
	}
	return &Controller{inv: inv, log: log}
}

func (c *Controller) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// checkCapabilities says why caps cannot be served on a volume (shared:
// created with ParamShared), or nil.
func checkCapabilities(caps []*csi.VolumeCapability, shared bool) error {
	if len(caps) == 0 {
		return status.Error(codes.InvalidArgument, "no volume capabilities")
	}
	for _, c := range caps {
		block := c.GetBlock() != nil
		if !block && c.GetMount() == nil {
			return status.Error(codes.InvalidArgument, "a volume capability without an access type (block or mount)")
		}
		if m := c.GetMount(); m != nil {
			switch m.FsType {
			case "", "ext4", "xfs":
			default:
				return status.Errorf(codes.InvalidArgument, "file system %q: rblk-csi makes ext4 or xfs", m.FsType)
			}
		}
		if c.GetAccessMode() == nil {
			return status.Error(codes.InvalidArgument, "a volume capability without an access mode")
		}
		switch mode := c.GetAccessMode().GetMode(); mode {
		case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
			csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		case csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
			if !block || !shared {
				return status.Errorf(codes.InvalidArgument, "access mode %v: only for block volumes of a StorageClass with %s: \"true\" (a file system on it would be corrupted)", mode, ParamShared)
			}
		default:
			return status.Errorf(codes.InvalidArgument, "access mode %v is not supported", mode)
		}
	}
	return nil
}

// size is the size to create for r: the required bytes (DefaultVolumeSize
// if none) rounded up to a MiB, or to 4 KiB where the limit is closer.
func size(r *csi.CapacityRange) (int64, error) {
	req, limit := r.GetRequiredBytes(), r.GetLimitBytes()
	if req < 0 || limit < 0 {
		return 0, status.Error(codes.InvalidArgument, "negative capacity")
	}
	if req == 0 {
		req = DefaultVolumeSize
		if limit > 0 && limit < req {
			req = limit
		}
	}
	n := (req + sizeUnit - 1) / sizeUnit * sizeUnit
	if limit > 0 && n > limit {
		n = (req + blockUnit - 1) / blockUnit * blockUnit
	}
	if limit > 0 && n > limit {
		return 0, status.Errorf(codes.OutOfRange, "capacity: %d bytes required, at most %d: no multiple of %d bytes fits", req, limit, blockUnit)
	}
	return n, nil
}

// found is a volume on a target.
type found struct {
	t *target
	v *managepb.Volume
}

func (f found) id() volumeID { return volumeID{Target: f.t.Name, Pool: f.v.Pool, Name: f.v.Name} }

// csiVolume is f as CSI reports it.
func (f found) csiVolume() *csi.Volume {
	v := &csi.Volume{VolumeId: f.id().String(), CapacityBytes: f.v.SizeBytes,
		VolumeContext: map[string]string{CtxTarget: f.t.Name, CtxAddress: f.t.Address, CtxTransport: f.t.Transport, CtxExport: f.v.Export}}
	if len(f.v.Labels) > 0 {
		v.AccessibleTopology = []*csi.Topology{{Segments: maps.Clone(f.v.Labels)}}
	}
	return v
}

// lookup finds the volume of id (NotFound if there is none).
func (c *Controller) lookup(ctx context.Context, id string) (found, error) {
	vid, err := parseVolumeID(id)
	if err != nil {
		return found{}, status.Errorf(codes.NotFound, "no volume %q: %v", id, err)
	}
	t := c.inv.targets[vid.Target]
	if t == nil {
		return found{}, status.Errorf(codes.NotFound, "volume %q: target %q is not in the inventory", id, vid.Target)
	}
	r, err := t.api.GetVolume(ctx, &managepb.GetVolumeRequest{Pool: vid.Pool, Name: vid.Name})
	if err != nil {
		return found{}, fromTarget(t, "get volume "+id, err)
	}
	return found{t: t, v: r.Volume}, nil
}

// fromTarget is a target's error as the controller's: its code, the
// target named.
func fromTarget(t *target, what string, err error) error {
	st := status.Convert(err)
	return status.Errorf(st.Code(), "%s on target %s: %s", what, t.Name, st.Message())
}

// findByName looks for volume name on every target (in pool, if not
// empty). A target that does not answer fails it: the volume might be
// there.
func (c *Controller) findByName(ctx context.Context, name, pool string) (*found, error) {
	for _, tn := range c.inv.names {
		t := c.inv.targets[tn]
		r, err := t.api.ListVolumes(ctx, &managepb.ListVolumesRequest{Pool: pool})
		if status.Code(err) == codes.NotFound && pool != "" {
			continue // (no such pool there)
		}
		if err != nil {
			return nil, fromTarget(t, "list volumes", err)
		}
		for _, v := range r.Volumes {
			if v.Name == name {
				return &found{t: t, v: v}, nil
			}
		}
	}
	return nil, nil
}

// candidate is a pool a volume may be created in.
type candidate struct {
	t         *target
	p         *managepb.Pool
	preferred int // the index of the first preferred segment it matches; len(preferred) if none
}

// matches reports whether labels satisfy segment (each key of it equal).
func matches(labels, segment map[string]string) bool {
	for k, v := range segment {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// allowed reports whether labels satisfy the requirement (one of its
// requisite segments, if it has any), and the rank of the preferred
// segment it matches.
func allowed(labels map[string]string, req *csi.TopologyRequirement) (bool, int) {
	if req == nil {
		return true, 0
	}
	ok := len(req.Requisite) == 0
	for _, s := range req.Requisite {
		if matches(labels, s.Segments) {
			ok = true
			break
		}
	}
	for i, s := range req.Preferred {
		if matches(labels, s.Segments) {
			return ok || len(req.Requisite) == 0, i
		}
	}
	return ok, len(req.Preferred)
}

// place picks the pool for a volume of n bytes: one the topology and
// the pool parameter allow, the first preferred, then the most room.
func (c *Controller) place(ctx context.Context, n int64, poolName string, req *csi.TopologyRequirement) (*candidate, error) {
	var cands []candidate
	var unreachable []string
	for _, tn := range c.inv.names {
		t := c.inv.targets[tn]
		r, err := t.api.ListPools(ctx, &managepb.ListPoolsRequest{Pool: poolName})
		if err != nil {
			if status.Code(err) != codes.NotFound {
				unreachable = append(unreachable, fmt.Sprintf("%s: %v", t.Name, status.Convert(err).Message()))
			}
			continue
		}
		for _, p := range r.Pools {
			if ok, rank := allowed(p.Labels, req); ok {
				cands = append(cands, candidate{t: t, p: p, preferred: rank})
			}
		}
	}
	sort.SliceStable(cands, func(i, j int) bool {
		if cands[i].preferred != cands[j].preferred {
			return cands[i].preferred < cands[j].preferred
		}
		return cands[i].p.AvailableBytes > cands[j].p.AvailableBytes
	})
	for _, cd := range cands {
		if cd.p.AvailableBytes >= n {
			return &cd, nil
		}
	}
	msg := fmt.Sprintf("no pool the topology and parameters allow has %d bytes available (%d pools allowed)", n, len(cands))
	if len(unreachable) > 0 {
		msg += "; not reached: " + strings.Join(unreachable, "; ")
	}
	return nil, status.Error(codes.ResourceExhausted, msg)
}

func (c *Controller) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.Name == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume name")
	}
	if req.VolumeContentSource != nil {
		return nil, status.Error(codes.InvalidArgument, "rblk-csi creates empty volumes only (no snapshot or clone source)")
	}
	poolName, shared := "", false
	for k, v := range req.Parameters {
		switch k {
		case ParamPool:
			poolName = v
		case ParamShared:
			b, err := strconv.ParseBool(v)
			if err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "parameter %s: %q: want true or false", ParamShared, v)
			}
			shared = b
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return nil, status.Errorf(codes.InvalidArgument, "unknown parameter %q (want %s or %s)", k, ParamPool, ParamShared)
			}
		}
	}
	if err := checkCapabilities(req.VolumeCapabilities, shared); err != nil {
		return nil, err
	}
	n, err := size(req.CapacityRange)
	if err != nil {
		return nil, err
	}
	name := volumeName(req.Name)
	existing, err := c.findByName(ctx, name, poolName)
	if err != nil {
		return nil, err
	}
	if existing != nil {
		v := existing.v
		if v.SizeBytes < req.CapacityRange.GetRequiredBytes() || (req.CapacityRange.GetLimitBytes() > 0 && v.SizeBytes > req.CapacityRange.GetLimitBytes()) || v.Shared != shared {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists as %s with %d bytes, shared %v: not what is asked", req.Name, existing.id(), v.SizeBytes, v.Shared)
		}
		return &csi.CreateVolumeResponse{Volume: existing.csiVolume()}, nil
	}
	cd, err := c.place(ctx, n, poolName, req.AccessibilityRequirements)
	if err != nil {
		return nil, err
	}
	r, err := cd.t.api.CreateVolume(ctx, &managepb.CreateVolumeRequest{Pool: cd.p.Name, Name: name, SizeBytes: n, Shared: shared})
	if err != nil {
		return nil, fromTarget(cd.t, "create volume "+name, err)
	}
	f := found{t: cd.t, v: r.Volume}
	c.log.Info("volume created", zap.String("name", req.Name), zap.String("volume_id", f.id().String()), zap.Int64("bytes", n))
	return &csi.CreateVolumeResponse{Volume: f.csiVolume()}, nil
}

func (c *Controller) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	vid, err := parseVolumeID(req.VolumeId)
	if err != nil {
		return &csi.DeleteVolumeResponse{}, nil // (no such volume can exist)
	}
	t := c.inv.targets[vid.Target]
	if t == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %q: target %q is not in the inventory: cannot tell whether it is gone", req.VolumeId, vid.Target)
	}
	_, err = t.api.DeleteVolume(ctx, &managepb.DeleteVolumeRequest{Pool: vid.Pool, Name: vid.Name})
	if err != nil && status.Code(err) != codes.NotFound {
		return nil, fromTarget(t, "delete volume "+req.VolumeId, err)
	}
	c.log.Info("volume deleted", zap.String("volume_id", req.VolumeId))
	return &csi.DeleteVolumeResponse{}, nil
}

// singleNode reports whether caps allow one node at a time.
func singleNode(c *csi.VolumeCapability) bool {
	switch c.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER:
		return false
	}
	return true
}

func (c *Controller) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	switch {
	case req.VolumeId == "":
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	case req.NodeId == "":
		return nil, status.Error(codes.InvalidArgument, "no node ID")
	case req.VolumeCapability == nil:
		return nil, status.Error(codes.InvalidArgument, "no volume capability")
	}
	f, err := c.lookup(ctx, req.VolumeId)
	if err != nil {
		return nil, err
	}
	if err := checkCapabilities([]*csi.VolumeCapability{req.VolumeCapability}, f.v.Shared); err != nil {
		return nil, err
	}
	if singleNode(req.VolumeCapability) {
		for _, h := range f.v.Hosts {
			if h != req.NodeId {
				return nil, status.Errorf(codes.FailedPrecondition, "volume %q is published to node %q: a single-node volume is unpublished there first", req.VolumeId, h)
			}
		}
	}
	if _, err := f.t.api.PublishVolume(ctx, &managepb.PublishVolumeRequest{Pool: f.v.Pool, Name: f.v.Name, HostId: req.NodeId}); err != nil {
		return nil, fromTarget(f.t, fmt.Sprintf("publish volume %s to node %s", req.VolumeId, req.NodeId), err)
	}
	c.log.Info("volume published", zap.String("volume_id", req.VolumeId), zap.String("node_id", req.NodeId))
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{}}, nil
}

func (c *Controller) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	f, err := c.lookup(ctx, req.VolumeId)
	if status.Code(err) == codes.NotFound {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	nodes := []string{req.NodeId}
	if req.NodeId == "" {
		nodes = f.v.Hosts // (every node)
	}
	for _, n := range nodes {
		r, err := f.t.api.UnpublishVolume(ctx, &managepb.UnpublishVolumeRequest{Pool: f.v.Pool, Name: f.v.Name, HostId: n})
		if err != nil && status.Code(err) != codes.NotFound {
			return nil, fromTarget(f.t, fmt.Sprintf("unpublish volume %s from node %s", req.VolumeId, n), err)
		}
		c.log.Info("volume unpublished: node fenced", zap.String("volume_id", req.VolumeId), zap.String("node_id", n), zap.Int32("sessions_fenced", r.GetSessionsFenced()))
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (c *Controller) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	if len(req.VolumeCapabilities) == 0 {
		return nil, status.Error(codes.InvalidArgument, "no volume capabilities")
	}
	f, err := c.lookup(ctx, req.VolumeId)
	if err != nil {
		return nil, err
	}
	if err := checkCapabilities(req.VolumeCapabilities, f.v.Shared); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.VolumeContext, VolumeCapabilities: req.VolumeCapabilities, Parameters: req.Parameters}}, nil
}

func (c *Controller) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	start := 0
	if req.StartingToken != "" {
		n, err := strconv.Atoi(req.StartingToken)
		if err != nil || n < 0 {
			return nil, status.Errorf(codes.Aborted, "starting token %q: not one ListVolumes gave", req.StartingToken)
		}
		start = n
	}
	if req.MaxEntries < 0 {
		return nil, status.Error(codes.InvalidArgument, "negative max_entries")
	}
	var all []found
	for _, tn := range c.inv.names {
		t := c.inv.targets[tn]
		r, err := t.api.ListVolumes(ctx, &managepb.ListVolumesRequest{})
		if err != nil {
			return nil, fromTarget(t, "list volumes", err)
		}
		for _, v := range r.Volumes {
			all = append(all, found{t: t, v: v})
		}
	}
	if start > len(all) {
		return nil, status.Errorf(codes.Aborted, "starting token %q: past the %d volumes", req.StartingToken, len(all))
	}
	end := len(all)
	if req.MaxEntries > 0 && start+int(req.MaxEntries) < end {
		end = start + int(req.MaxEntries)
	}
	out := &csi.ListVolumesResponse{}
	for _, f := range all[start:end] {
		out.Entries = append(out.Entries, &csi.ListVolumesResponse_Entry{Volume: f.csiVolume(),
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: slices.Clone(f.v.Hosts)}})
	}
	if end < len(all) {
		out.NextToken = strconv.Itoa(end)
	}
	return out, nil
}

func (c *Controller) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	poolName := req.Parameters[ParamPool]
	var total, largest int64
	for _, tn := range c.inv.names {
		t := c.inv.targets[tn]
		r, err := t.api.ListPools(ctx, &managepb.ListPoolsRequest{Pool: poolName})
		if status.Code(err) == codes.NotFound {
			continue
		}
		if err != nil {
			return nil, fromTarget(t, "list pools", err)
		}
		for _, p := range r.Pools {
			if req.AccessibleTopology != nil && !matches(p.Labels, req.AccessibleTopology.Segments) {
				continue
			}
			total += p.AvailableBytes
			largest = max(largest, p.AvailableBytes)
		}
	}
	return &csi.GetCapacityResponse{AvailableCapacity: total, MaximumVolumeSize: wrapperspb.Int64(largest)}, nil
}

func (c *Controller) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	if req.CapacityRange == nil {
		return nil, status.Error(codes.InvalidArgument, "no capacity range")
	}
	f, err := c.lookup(ctx, req.VolumeId)
	if err != nil {
		return nil, err
	}
	n, err := size(req.CapacityRange)
	if err != nil {
		return nil, err
	}
	nodeExpansion := req.VolumeCapability.GetBlock() == nil
	if n <= f.v.SizeBytes {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: f.v.SizeBytes, NodeExpansionRequired: nodeExpansion}, nil
	}
	r, err := f.t.api.ExpandVolume(ctx, &managepb.ExpandVolumeRequest{Pool: f.v.Pool, Name: f.v.Name, SizeBytes: n})
	if err != nil {
		return nil, fromTarget(f.t, "expand volume "+req.VolumeId, err)
	}
	c.log.Info("volume expanded", zap.String("volume_id", req.VolumeId), zap.Int64("bytes", r.Volume.SizeBytes))
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: r.Volume.SizeBytes, NodeExpansionRequired: nodeExpansion}, nil
}
