package csidriver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/rblk/rblk/manage/managepb"
	"github.com/rblk/rblk/mirror"
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
	// The second copy of a mirror (replicas: 2): its target, address,
	// transport and export. The keys above name the first.
	CtxMirrorTarget    = "rblk.io/mirror-target"
	CtxMirrorAddress   = "rblk.io/mirror-address"
	CtxMirrorTransport = "rblk.io/mirror-transport"
	CtxMirrorExport    = "rblk.io/mirror-export"
)

// StorageClass parameters.
const (
	// ParamPool picks the pool (default: the one with the most room
	// that the topology allows).
	ParamPool = "pool"
	// ParamShared "true": several nodes may write at once (block volumes
	// of MULTI_NODE_MULTI_WRITER, for cluster file systems).
	ParamShared = "shared"
	// ParamReplicas is the number of copies: 1 (the default) or 2, a
	// mirror: one copy on each of two targets in different topology
	// segments, which the node assembles into an md RAID1.
	ParamReplicas = "replicas"
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

// replica is a copy of a volume: the volume on a target.
type replica struct {
	t *target
	v *managepb.Volume
}

// found is a volume: its copies (one, or two for a mirror, in the order
// of their targets' names).
type found []replica

func (f found) id() volumeID {
	id := volumeID{Name: f[0].v.Name}
	for _, r := range f {
		id.Copies = append(id.Copies, copyID{Target: r.t.Name, Pool: r.v.Pool})
	}
	return id
}

// size is the volume's size: its smallest copy's, less md's room on each
// for a mirror.
func (f found) size() int64 {
	n := f[0].v.SizeBytes
	for _, r := range f[1:] {
		n = min(n, r.v.SizeBytes)
	}
	return n - copyOverhead(len(f))
}

// copyOverhead is how much larger than the volume each copy is: md's
// superblock and bitmap on a mirror's copies (replicas > 1).
func copyOverhead(replicas int) int64 {
	if replicas > 1 {
		return mirror.DataOffset
	}
	return 0
}

// hosts are the nodes the volume is published to (on any copy).
func (f found) hosts() []string {
	var hs []string
	for _, r := range f {
		for _, h := range r.v.Hosts {
			if !slices.Contains(hs, h) {
				hs = append(hs, h)
			}
		}
	}
	return hs
}

// csiVolume is f as CSI reports it. A mirror is reachable from either
// copy's topology segment.
func (f found) csiVolume() *csi.Volume {
	r := f[0]
	v := &csi.Volume{VolumeId: f.id().String(), CapacityBytes: f.size(),
		VolumeContext: map[string]string{CtxTarget: r.t.Name, CtxAddress: r.t.Address, CtxTransport: r.t.Transport, CtxExport: r.v.Export}}
	if len(f) == 2 {
		m := f[1]
		maps.Copy(v.VolumeContext, map[string]string{CtxMirrorTarget: m.t.Name, CtxMirrorAddress: m.t.Address,
			CtxMirrorTransport: m.t.Transport, CtxMirrorExport: m.v.Export})
	}
	for _, r := range f {
		if len(r.v.Labels) == 0 {
			continue
		}
		if !slices.ContainsFunc(v.AccessibleTopology, func(t *csi.Topology) bool { return maps.Equal(t.Segments, r.v.Labels) }) {
			v.AccessibleTopology = append(v.AccessibleTopology, &csi.Topology{Segments: maps.Clone(r.v.Labels)})
		}
	}
	return v
}

// lookup finds the volume of id, every copy (NotFound if one is
// missing).
func (c *Controller) lookup(ctx context.Context, id string) (found, error) {
	vid, err := parseVolumeID(id)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "no volume %q: %v", id, err)
	}
	var f found
	for _, cp := range vid.Copies {
		t := c.inv.targets[cp.Target]
		if t == nil {
			return nil, status.Errorf(codes.NotFound, "volume %q: target %q is not in the inventory", id, cp.Target)
		}
		r, err := t.api.GetVolume(ctx, &managepb.GetVolumeRequest{Pool: cp.Pool, Name: vid.Name})
		if err != nil {
			return nil, fromTarget(t, "get volume "+id, err)
		}
		f = append(f, replica{t: t, v: r.Volume})
	}
	return f, nil
}

// fromTarget is a target's error as the controller's: its code, the
// target named.
func fromTarget(t *target, what string, err error) error {
	st := status.Convert(err)
	return status.Errorf(st.Code(), "%s on target %s: %s", what, t.Name, st.Message())
}

// findByName finds the copies of volume name on every target (in pool,
// if not empty), in the order of the targets' names. A target that does
// not answer fails it: a copy might be there.
func (c *Controller) findByName(ctx context.Context, name, pool string) (found, error) {
	var f found
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
				f = append(f, replica{t: t, v: v})
			}
		}
	}
	return f, nil
}

// candidate is a pool a volume may be created in.
type candidate struct {
	t         *target
	p         *managepb.Pool
	preferred int  // the index of the first preferred segment it matches; len(preferred) if none
	outside   bool // not in a requisite segment (a mirror's second copy may be)
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

// apart reports whether a copy in pool p of target t is in another
// failure domain than every copy of f: on another target and, where
// both pools carry topology labels, in another segment.
func apart(t *target, p *managepb.Pool, f found) bool {
	for _, r := range f {
		if r.t == t || len(p.Labels) > 0 && len(r.v.Labels) > 0 && maps.Equal(p.Labels, r.v.Labels) {
			return false
		}
	}
	return true
}

// place picks the pool for a copy of n bytes: one the topology and the
// pool parameter allow, apart from the copies in others; the first
// preferred, then the one with the most room. A second copy (others not
// empty) goes to a requisite segment where one is apart, else to any.
func (c *Controller) place(ctx context.Context, n int64, poolName string, req *csi.TopologyRequirement, others found) (*candidate, error) {
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
			ok, rank := allowed(p.Labels, req)
			// A mirror's second copy need not be in a requisite segment:
			// the volume is reachable from the first copy's (CSI asks
			// that of one requisite segment), and from the second's, for
			// when the first segment is lost.
			if (ok || len(others) > 0) && apart(t, p, others) {
				cands = append(cands, candidate{t: t, p: p, outside: !ok, preferred: rank})
			}
		}
	}
	sort.SliceStable(cands, func(i, j int) bool {
		if cands[i].outside != cands[j].outside {
			return !cands[i].outside
		}
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
	if len(others) > 0 {
		msg = fmt.Sprintf("no pool for the second copy: none the topology and parameters allow, on another target and in another topology segment than %s, has %d bytes available (%d pools allowed)",
			others[0].t.Name, n, len(cands))
	}
	if len(unreachable) > 0 {
		msg += "; not reached: " + strings.Join(unreachable, "; ")
	}
	return nil, status.Error(codes.ResourceExhausted, msg)
}

// createParams are a CreateVolume's parameters.
type createParams struct {
	pool     string
	shared   bool
	replicas int
}

// CheckParameters says why CreateVolume refuses a StorageClass's
// parameters, or nil.
func CheckParameters(params map[string]string) error {
	_, err := parseParams(params)
	return err
}

func parseParams(params map[string]string) (createParams, error) {
	p := createParams{replicas: 1}
	for k, v := range params {
		switch k {
		case ParamPool:
			p.pool = v
		case ParamShared:
			b, err := strconv.ParseBool(v)
			if err != nil {
				return p, status.Errorf(codes.InvalidArgument, "parameter %s: %q: want true or false", ParamShared, v)
			}
			p.shared = b
		case ParamReplicas:
			switch v {
			case "1", "2":
				p.replicas = int(v[0] - '0')
			default:
				return p, status.Errorf(codes.InvalidArgument, "parameter %s: %q: want 1 or 2", ParamReplicas, v)
			}
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "unknown parameter %q (want %s, %s or %s)", k, ParamPool, ParamShared, ParamReplicas)
			}
		}
	}
	if p.shared && p.replicas > 1 {
		return p, status.Errorf(codes.InvalidArgument, "parameters %s: \"true\" and %s: 2: a mirror is one node's (md RAID1 is assembled on one node)", ParamShared, ParamReplicas)
	}
	return p, nil
}

func (c *Controller) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.Name == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume name")
	}
	if req.VolumeContentSource != nil {
		return nil, status.Error(codes.InvalidArgument, "rblk-csi creates empty volumes only (no snapshot or clone source)")
	}
	p, err := parseParams(req.Parameters)
	if err != nil {
		return nil, err
	}
	if err := checkCapabilities(req.VolumeCapabilities, p.shared); err != nil {
		return nil, err
	}
	if p.replicas > 1 {
		if err := checkMirrorCapabilities(req.VolumeCapabilities); err != nil {
			return nil, err
		}
	}
	n, err := size(req.CapacityRange)
	if err != nil {
		return nil, err
	}
	name := volumeName(req.Name)
	existing, err := c.findByName(ctx, name, p.pool)
	if err != nil {
		return nil, err
	}
	over := copyOverhead(p.replicas)
	for _, r := range existing {
		v, usable := r.v, r.v.SizeBytes-over
		if len(existing) > p.replicas || len(existing) == 2 && existing[0].t == existing[1].t || usable < req.CapacityRange.GetRequiredBytes() ||
			(req.CapacityRange.GetLimitBytes() > 0 && usable > req.CapacityRange.GetLimitBytes()) || v.Shared != p.shared {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists as %s with %d bytes, shared %v: not what is asked", req.Name, existing.id(), usable, v.Shared)
		}
	}
	created := found{}
	for len(existing) < p.replicas {
		// (A copy made by an earlier call that failed after it stays: the
		// retry makes the one it lacks.)
		cd, err := c.place(ctx, n+over, p.pool, req.AccessibilityRequirements, existing)
		if err == nil {
			var r *managepb.CreateVolumeResponse
			if r, err = cd.t.api.CreateVolume(ctx, &managepb.CreateVolumeRequest{Pool: cd.p.Name, Name: name, SizeBytes: n + over, Shared: p.shared}); err == nil {
				existing = append(existing, replica{t: cd.t, v: r.Volume})
				created = append(created, replica{t: cd.t, v: r.Volume})
				continue
			}
			err = fromTarget(cd.t, "create volume "+name, err)
		}
		c.undoCreate(created)
		return nil, err
	}
	sort.Slice(existing, func(i, j int) bool { return existing[i].t.Name < existing[j].t.Name })
	id := existing.id().String()
	if len(id) > maxVolumeID {
		c.undoCreate(created)
		return nil, status.Errorf(codes.InvalidArgument, "volume ID %s: %d bytes, CSI allows %d: name the targets or pools shorter", id, len(id), maxVolumeID)
	}
	if len(created) > 0 {
		c.log.Info("volume created", zap.String("name", req.Name), zap.String("volume_id", id), zap.Int64("bytes", n), zap.Int("copies", len(existing)))
	}
	return &csi.CreateVolumeResponse{Volume: existing.csiVolume()}, nil
}

// undoCreate deletes the copies a failed CreateVolume made (the first
// copy of a mirror whose second has no place): none is left behind
// where it can.
func (c *Controller) undoCreate(f found) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, r := range f {
		if _, err := r.t.api.DeleteVolume(ctx, &managepb.DeleteVolumeRequest{Pool: r.v.Pool, Name: r.v.Name}); err != nil {
			c.log.Warn("a copy of a volume not created is left", zap.String("target", r.t.Name), zap.String("pool", r.v.Pool),
				zap.String("name", r.v.Name), zap.Error(err))
		}
	}
}

// DeleteVolume deletes every copy of the volume.
func (c *Controller) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	vid, err := parseVolumeID(req.VolumeId)
	if err != nil {
		return &csi.DeleteVolumeResponse{}, nil // (no such volume can exist)
	}
	for _, cp := range vid.Copies {
		if c.inv.targets[cp.Target] == nil {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %q: target %q is not in the inventory: cannot tell whether it is gone", req.VolumeId, cp.Target)
		}
	}
	for _, cp := range vid.Copies {
		t := c.inv.targets[cp.Target]
		_, err = t.api.DeleteVolume(ctx, &managepb.DeleteVolumeRequest{Pool: cp.Pool, Name: vid.Name})
		if err != nil && status.Code(err) != codes.NotFound {
			return nil, fromTarget(t, "delete volume "+req.VolumeId, err)
		}
	}
	c.log.Info("volume deleted", zap.String("volume_id", req.VolumeId))
	return &csi.DeleteVolumeResponse{}, nil
}

// checkMirrorCapabilities refuses an access mode of several nodes for a
// mirror: its md array is one node's (each node that assembled it would
// write its superblock and bitmap).
func checkMirrorCapabilities(caps []*csi.VolumeCapability) error {
	for _, c := range caps {
		if !singleNode(c) {
			return status.Errorf(codes.InvalidArgument, "access mode %v: a volume of %s: 2 is one node's (its md array is assembled on one node)",
				c.GetAccessMode().GetMode(), ParamReplicas)
		}
	}
	return nil
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
	if err := checkCapabilities([]*csi.VolumeCapability{req.VolumeCapability}, f[0].v.Shared); err != nil {
		return nil, err
	}
	if len(f) > 1 {
		if err := checkMirrorCapabilities([]*csi.VolumeCapability{req.VolumeCapability}); err != nil {
			return nil, err
		}
	}
	if singleNode(req.VolumeCapability) {
		for _, h := range f.hosts() {
			if h != req.NodeId {
				return nil, status.Errorf(codes.FailedPrecondition, "volume %q is published to node %q: a single-node volume is unpublished there first", req.VolumeId, h)
			}
		}
	}
	// Every copy: a mirror's node attaches both. (A copy's target that
	// does not answer fails the call; the CO tries again.)
	for _, r := range f {
		if _, err := r.t.api.PublishVolume(ctx, &managepb.PublishVolumeRequest{Pool: r.v.Pool, Name: r.v.Name, HostId: req.NodeId}); err != nil {
			return nil, fromTarget(r.t, fmt.Sprintf("publish volume %s to node %s", req.VolumeId, req.NodeId), err)
		}
	}
	c.log.Info("volume published", zap.String("volume_id", req.VolumeId), zap.String("node_id", req.NodeId))
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{}}, nil
}

// ControllerUnpublishVolume fences the node on every copy: it succeeds
// only once no copy's target lets it write (a copy's target that does not
// answer fails it, and the CO tries again: the node might still write
// there once it is back).
func (c *Controller) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if req.VolumeId == "" {
		return nil, status.Error(codes.InvalidArgument, "no volume ID")
	}
	vid, err := parseVolumeID(req.VolumeId)
	if err != nil {
		return &csi.ControllerUnpublishVolumeResponse{}, nil // (no such volume can exist)
	}
	for _, cp := range vid.Copies {
		t := c.inv.targets[cp.Target]
		if t == nil {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %q: target %q is not in the inventory: the node cannot be fenced there", req.VolumeId, cp.Target)
		}
		nodes := []string{req.NodeId}
		if req.NodeId == "" { // (every node)
			r, err := t.api.GetVolume(ctx, &managepb.GetVolumeRequest{Pool: cp.Pool, Name: vid.Name})
			if status.Code(err) == codes.NotFound {
				continue
			}
			if err != nil {
				return nil, fromTarget(t, "get volume "+req.VolumeId, err)
			}
			nodes = r.Volume.Hosts
		}
		for _, n := range nodes {
			r, err := t.api.UnpublishVolume(ctx, &managepb.UnpublishVolumeRequest{Pool: cp.Pool, Name: vid.Name, HostId: n})
			if status.Code(err) == codes.NotFound {
				continue // (no such volume there, or not published to n)
			}
			if err != nil {
				return nil, fromTarget(t, fmt.Sprintf("unpublish volume %s from node %s", req.VolumeId, n), err)
			}
			c.log.Info("volume unpublished: node fenced", zap.String("volume_id", req.VolumeId), zap.String("target", t.Name),
				zap.String("node_id", n), zap.Int32("sessions_fenced", r.GetSessionsFenced()))
		}
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
	err = checkCapabilities(req.VolumeCapabilities, f[0].v.Shared)
	if err == nil && len(f) > 1 {
		err = checkMirrorCapabilities(req.VolumeCapabilities)
	}
	if err != nil {
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
	// The copies of a mirror are the volumes of one name on two targets
	// (a name is one CSI volume's).
	var all []found
	byName := map[string]int{}
	for _, tn := range c.inv.names {
		t := c.inv.targets[tn]
		r, err := t.api.ListVolumes(ctx, &managepb.ListVolumesRequest{})
		if err != nil {
			return nil, fromTarget(t, "list volumes", err)
		}
		for _, v := range r.Volumes {
			if i, ok := byName[v.Name]; ok && len(all[i]) == 1 && all[i][0].t != t {
				all[i] = append(all[i], replica{t: t, v: v})
				continue
			}
			byName[v.Name] = len(all)
			all = append(all, found{{t: t, v: v}})
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
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: f.hosts()}})
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
	// A mirror's array grows on the node, block volume or not.
	nodeExpansion := req.VolumeCapability.GetBlock() == nil || len(f) > 1
	if n <= f.size() {
		return &csi.ControllerExpandVolumeResponse{CapacityBytes: f.size(), NodeExpansionRequired: nodeExpansion}, nil
	}
	over := copyOverhead(len(f))
	got := int64(-1)
	for _, r := range f {
		if r.v.SizeBytes >= n+over {
			got = minSize(got, r.v.SizeBytes-over)
			continue
		}
		x, err := r.t.api.ExpandVolume(ctx, &managepb.ExpandVolumeRequest{Pool: r.v.Pool, Name: r.v.Name, SizeBytes: n + over})
		if err != nil {
			return nil, fromTarget(r.t, "expand volume "+req.VolumeId, err)
		}
		got = minSize(got, x.Volume.SizeBytes-over)
	}
	c.log.Info("volume expanded", zap.String("volume_id", req.VolumeId), zap.Int64("bytes", got))
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: got, NodeExpansionRequired: nodeExpansion}, nil
}

// minSize is the smaller of a and b, where a < 0 is none yet.
func minSize(a, b int64) int64 {
	if a < 0 {
		return b
	}
	return min(a, b)
}
