package csidriver

import (
	"context"
	"maps"
	"slices"
	"sort"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rblk/rblk/manage/managepb"
	"github.com/rblk/rblk/mirror"
)

// fakeAPI is a target's management API in memory: its pools (labels and
// room) and volumes. down makes every call Unavailable; failCreate fails
// CreateVolume.
type fakeAPI struct {
	managepb.ManageClient // (the calls the controller does not make)

	mu         sync.Mutex
	pools      map[string]*managepb.Pool
	vols       map[string]*managepb.Volume // POOL/NAME
	down       bool
	failCreate bool
	calls      []string
}

func newFakeAPI(pools ...*managepb.Pool) *fakeAPI {
	f := &fakeAPI{pools: map[string]*managepb.Pool{}, vols: map[string]*managepb.Volume{}}
	for _, p := range pools {
		f.pools[p.Name] = p
	}
	return f
}

func (f *fakeAPI) call(what string) error {
	f.calls = append(f.calls, what)
	if f.down {
		return status.Error(codes.Unavailable, "connection refused")
	}
	return nil
}

func (f *fakeAPI) ListPools(_ context.Context, in *managepb.ListPoolsRequest, _ ...grpc.CallOption) (*managepb.ListPoolsResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("ListPools"); err != nil {
		return nil, err
	}
	r := &managepb.ListPoolsResponse{}
	for _, p := range f.pools {
		if in.Pool == "" || in.Pool == p.Name {
			r.Pools = append(r.Pools, p)
		}
	}
	if in.Pool != "" && len(r.Pools) == 0 {
		return nil, status.Errorf(codes.NotFound, "no pool %q", in.Pool)
	}
	sort.Slice(r.Pools, func(i, j int) bool { return r.Pools[i].Name < r.Pools[j].Name })
	return r, nil
}

func (f *fakeAPI) CreateVolume(_ context.Context, in *managepb.CreateVolumeRequest, _ ...grpc.CallOption) (*managepb.CreateVolumeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("CreateVolume"); err != nil {
		return nil, err
	}
	if f.failCreate {
		return nil, status.Error(codes.Internal, "disk on fire")
	}
	p := f.pools[in.Pool]
	if p == nil {
		return nil, status.Errorf(codes.NotFound, "no pool %q", in.Pool)
	}
	if v := f.vols[in.Pool+"/"+in.Name]; v != nil {
		return &managepb.CreateVolumeResponse{Volume: v}, nil
	}
	v := &managepb.Volume{Pool: in.Pool, Name: in.Name, Export: in.Pool + ":" + in.Name, SizeBytes: in.SizeBytes, Shared: in.Shared, Labels: maps.Clone(p.Labels)}
	f.vols[in.Pool+"/"+in.Name] = v
	p.AvailableBytes -= in.SizeBytes
	return &managepb.CreateVolumeResponse{Volume: v, Created: true}, nil
}

func (f *fakeAPI) DeleteVolume(_ context.Context, in *managepb.DeleteVolumeRequest, _ ...grpc.CallOption) (*managepb.DeleteVolumeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("DeleteVolume"); err != nil {
		return nil, err
	}
	v := f.vols[in.Pool+"/"+in.Name]
	if v == nil {
		return nil, status.Error(codes.NotFound, "no volume")
	}
	delete(f.vols, in.Pool+"/"+in.Name)
	f.pools[in.Pool].AvailableBytes += v.SizeBytes
	return &managepb.DeleteVolumeResponse{}, nil
}

func (f *fakeAPI) volume(pool, name string) (*managepb.Volume, error) {
	v := f.vols[pool+"/"+name]
	if v == nil {
		return nil, status.Errorf(codes.NotFound, "no volume %s/%s", pool, name)
	}
	return v, nil
}

func (f *fakeAPI) GetVolume(_ context.Context, in *managepb.GetVolumeRequest, _ ...grpc.CallOption) (*managepb.GetVolumeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("GetVolume"); err != nil {
		return nil, err
	}
	v, err := f.volume(in.Pool, in.Name)
	return &managepb.GetVolumeResponse{Volume: v}, err
}

func (f *fakeAPI) ListVolumes(_ context.Context, in *managepb.ListVolumesRequest, _ ...grpc.CallOption) (*managepb.ListVolumesResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("ListVolumes"); err != nil {
		return nil, err
	}
	if in.Pool != "" && f.pools[in.Pool] == nil {
		return nil, status.Errorf(codes.NotFound, "no pool %q", in.Pool)
	}
	r := &managepb.ListVolumesResponse{}
	for _, k := range slices.Sorted(maps.Keys(f.vols)) {
		if v := f.vols[k]; in.Pool == "" || v.Pool == in.Pool {
			r.Volumes = append(r.Volumes, v)
		}
	}
	return r, nil
}

func (f *fakeAPI) ExpandVolume(_ context.Context, in *managepb.ExpandVolumeRequest, _ ...grpc.CallOption) (*managepb.ExpandVolumeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("ExpandVolume"); err != nil {
		return nil, err
	}
	v, err := f.volume(in.Pool, in.Name)
	if err != nil {
		return nil, err
	}
	v.SizeBytes = max(v.SizeBytes, in.SizeBytes)
	return &managepb.ExpandVolumeResponse{Volume: v}, nil
}

func (f *fakeAPI) PublishVolume(_ context.Context, in *managepb.PublishVolumeRequest, _ ...grpc.CallOption) (*managepb.PublishVolumeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("PublishVolume"); err != nil {
		return nil, err
	}
	v, err := f.volume(in.Pool, in.Name)
	if err != nil {
		return nil, err
	}
	if !slices.Contains(v.Hosts, in.HostId) {
		v.Hosts = append(v.Hosts, in.HostId)
	}
	return &managepb.PublishVolumeResponse{Volume: v}, nil
}

func (f *fakeAPI) UnpublishVolume(_ context.Context, in *managepb.UnpublishVolumeRequest, _ ...grpc.CallOption) (*managepb.UnpublishVolumeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call("UnpublishVolume"); err != nil {
		return nil, err
	}
	v, err := f.volume(in.Pool, in.Name)
	if err != nil {
		return nil, err
	}
	i := slices.Index(v.Hosts, in.HostId)
	if i < 0 {
		return nil, status.Error(codes.NotFound, "not published there")
	}
	v.Hosts = slices.Delete(v.Hosts, i, i+1)
	return &managepb.UnpublishVolumeResponse{SessionsFenced: 1}, nil
}

// fakeInventory is an Inventory of the fake targets, by name.
func fakeInventory(apis map[string]*fakeAPI) *Inventory {
	inv := &Inventory{targets: map[string]*target{}}
	for name, api := range apis {
		inv.targets[name] = &target{TargetConfig: TargetConfig{Name: name, Address: name + ":7660", Transport: "tcp"}, api: api}
		inv.names = append(inv.names, name)
	}
	sort.Strings(inv.names)
	return inv
}

func zonePool(name, zone string, room int64) *managepb.Pool {
	return &managepb.Pool{Name: name, Labels: map[string]string{"topology.rblk.io/zone": zone}, AvailableBytes: room}
}

func mountCapability() *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
}

func mirrorRequest(name string) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{Name: name, Parameters: map[string]string{ParamReplicas: "2"},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, VolumeCapabilities: []*csi.VolumeCapability{mountCapability()}}
}

func zone(v *managepb.Volume) string { return v.Labels["topology.rblk.io/zone"] }

// TestCreateMirror: replicas: 2 places a copy on each of two targets in
// two zones, one ID naming both, in the order of the targets' names.
func TestCreateMirror(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name  string
		apis  map[string]*fakeAPI
		req   func(*csi.CreateVolumeRequest)
		code  codes.Code
		zones []string // of the copies, in the ID's order
	}{
		{name: "two zones", apis: map[string]*fakeAPI{"s-b": newFakeAPI(zonePool("fast", "b", 1<<30)), "s-a": newFakeAPI(zonePool("fast", "a", 1<<30))},
			zones: []string{"a", "b"}},
		// Two targets in zone a: the copies go to a and c, never both in a.
		{name: "apart", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "a", 4<<30)),
			"s3": newFakeAPI(zonePool("fast", "c", 1<<30))}, zones: []string{"a", "c"}},
		// The preferred zone gets a copy, though it has less room.
		{name: "preferred", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "b", 4<<30)),
			"s3": newFakeAPI(zonePool("fast", "c", 1<<30))},
			req: func(r *csi.CreateVolumeRequest) {
				r.AccessibilityRequirements = &csi.TopologyRequirement{Preferred: []*csi.Topology{{Segments: map[string]string{"topology.rblk.io/zone": "c"}}}}
			}, zones: []string{"a", "c"}},
		// The requisite zones alone: b and c, though a has the most room.
		{name: "requisite", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "b", 4<<30)),
			"s3": newFakeAPI(zonePool("fast", "c", 1<<30))},
			req: func(r *csi.CreateVolumeRequest) {
				r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{
					{Segments: map[string]string{"topology.rblk.io/zone": "b"}}, {Segments: map[string]string{"topology.rblk.io/zone": "c"}}}}
			}, zones: []string{"b", "c"}},
		// One requisite zone (the pod's node's): the second copy outside
		// it, the volume reachable from both.
		{name: "one requisite zone", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 1<<30)), "s2": newFakeAPI(zonePool("fast", "b", 4<<30))},
			req: func(r *csi.CreateVolumeRequest) {
				r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"topology.rblk.io/zone": "a"}}}}
			}, zones: []string{"a", "b"}},
		{name: "one zone", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "a", 4<<30))},
			code: codes.ResourceExhausted},
		{name: "one target", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30), zonePool("slow", "b", 8<<30))},
			code: codes.ResourceExhausted},
		{name: "no room for the second", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "b", 1<<20))},
			code: codes.ResourceExhausted},
		{name: "shared", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "b", 8<<30))},
			req: func(r *csi.CreateVolumeRequest) { r.Parameters[ParamShared] = "true" }, code: codes.InvalidArgument},
		{name: "three", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "b", 8<<30))},
			req: func(r *csi.CreateVolumeRequest) { r.Parameters[ParamReplicas] = "3" }, code: codes.InvalidArgument},
		{name: "multi-node", apis: map[string]*fakeAPI{"s1": newFakeAPI(zonePool("fast", "a", 8<<30)), "s2": newFakeAPI(zonePool("fast", "b", 8<<30))},
			req: func(r *csi.CreateVolumeRequest) {
				r.VolumeCapabilities[0].AccessMode.Mode = csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
			}, code: codes.InvalidArgument},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctrl := NewController(fakeInventory(c.apis), nil)
			req := mirrorRequest("pvc-1")
			if c.req != nil {
				c.req(req)
			}
			r, err := ctrl.CreateVolume(ctx, req)
			if status.Code(err) != c.code {
				t.Fatalf("CreateVolume: %v; want %v", err, c.code)
			}
			var left []string
			for name, api := range c.apis {
				for k := range api.vols {
					left = append(left, name+":"+k)
				}
			}
			if err != nil {
				if len(left) > 0 {
					t.Fatalf("a failed create left copies: %v", left)
				}
				return
			}
			id, err := parseVolumeID(r.Volume.VolumeId)
			if err != nil || !id.Mirror() {
				t.Fatalf("volume ID %q: %v; want a mirror's", r.Volume.VolumeId, err)
			}
			var zones []string
			for _, cp := range id.Copies {
				v := c.apis[cp.Target].vols[cp.Pool+"/"+id.Name]
				if v == nil {
					t.Fatalf("ID %s: no copy on %s", id, cp.Target)
				}
				zones = append(zones, zone(v))
			}
			for _, cp := range id.Copies {
				if n := c.apis[cp.Target].vols[cp.Pool+"/"+id.Name].SizeBytes; n != 64<<20+mirror.DataOffset {
					t.Errorf("copy on %s: %d bytes; want the volume's and md's room", cp.Target, n)
				}
			}
			if r.Volume.CapacityBytes != 64<<20 {
				t.Errorf("capacity %d; want 64 MiB", r.Volume.CapacityBytes)
			}
			if !slices.Equal(zones, c.zones) || len(left) != 2 {
				t.Errorf("copies in zones %v (volumes %v); want %v", zones, left, c.zones)
			}
			ctxKeys := r.Volume.VolumeContext
			if ctxKeys[CtxTarget] != id.Copies[0].Target || ctxKeys[CtxMirrorTarget] != id.Copies[1].Target ||
				ctxKeys[CtxExport] == "" || ctxKeys[CtxMirrorExport] == "" || ctxKeys[CtxMirrorAddress] != id.Copies[1].Target+":7660" {
				t.Errorf("volume context %v", ctxKeys)
			}
			if len(r.Volume.AccessibleTopology) != 2 {
				t.Errorf("accessible topology %v: want both copies' zones", r.Volume.AccessibleTopology)
			}
			// A retry finds the same volume and creates nothing.
			r2, err := ctrl.CreateVolume(ctx, req)
			if err != nil || r2.Volume.VolumeId != r.Volume.VolumeId {
				t.Fatalf("retried CreateVolume: %v, %v; want %s", r2, err, r.Volume.VolumeId)
			}
			// A single volume of the same name: AlreadyExists.
			single := mirrorRequest("pvc-1")
			delete(single.Parameters, ParamReplicas)
			if _, err := ctrl.CreateVolume(ctx, single); status.Code(err) != codes.AlreadyExists {
				t.Errorf("CreateVolume of replicas 1 over a mirror: %v; want AlreadyExists", err)
			}
		})
	}
}

// TestCreateMirrorRetry: a create that made the first copy and failed
// on the second deletes the first; one whose first copy an earlier call
// left (the controller died) makes the second.
func TestCreateMirrorRetry(t *testing.T) {
	ctx := context.Background()
	a, b := newFakeAPI(zonePool("fast", "a", 8<<30)), newFakeAPI(zonePool("fast", "b", 4<<30))
	ctrl := NewController(fakeInventory(map[string]*fakeAPI{"s1": a, "s2": b}), nil)
	b.failCreate = true
	if _, err := ctrl.CreateVolume(ctx, mirrorRequest("pvc-1")); status.Code(err) != codes.Internal {
		t.Fatalf("CreateVolume with the second copy failing: %v", err)
	}
	if len(a.vols)+len(b.vols) != 0 {
		t.Fatalf("left: %v %v", a.vols, b.vols)
	}
	b.failCreate = false
	a.vols["fast/pvc-1"] = &managepb.Volume{Pool: "fast", Name: "pvc-1", Export: "fast:pvc-1", SizeBytes: 68 << 20, Labels: a.pools["fast"].Labels}
	r, err := ctrl.CreateVolume(ctx, mirrorRequest("pvc-1"))
	if err != nil {
		t.Fatal(err)
	}
	if r.Volume.VolumeId != "s1/fast/s2/fast/pvc-1" || len(b.vols) != 1 || r.Volume.CapacityBytes != 64<<20 {
		t.Fatalf("volume %s, copies on s2 %v", r.Volume.VolumeId, b.vols)
	}
}

// TestMirrorLifecycle: publish, unpublish (the fence), expand, list and
// delete act on both copies; a copy's target down fails publish and
// unpublish (the CO retries) rather than leave a copy unfenced.
func TestMirrorLifecycle(t *testing.T) {
	ctx := context.Background()
	a, b := newFakeAPI(zonePool("fast", "a", 8<<30)), newFakeAPI(zonePool("fast", "b", 8<<30))
	ctrl := NewController(fakeInventory(map[string]*fakeAPI{"s1": a, "s2": b}), nil)
	single, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-0", VolumeCapabilities: []*csi.VolumeCapability{mountCapability()},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := ctrl.CreateVolume(ctx, mirrorRequest("pvc-1"))
	if err != nil {
		t.Fatal(err)
	}
	id := r.Volume.VolumeId
	both := func(what string, check func(v *managepb.Volume) bool) {
		t.Helper()
		for _, api := range []*fakeAPI{a, b} {
			if v := api.vols["fast/pvc-1"]; v == nil || !check(v) {
				t.Errorf("%s: copy %v", what, v)
			}
		}
	}
	pub := &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: mountCapability()}
	if _, err := ctrl.ControllerPublishVolume(ctx, pub); err != nil {
		t.Fatal(err)
	}
	both("published", func(v *managepb.Volume) bool { return slices.Equal(v.Hosts, []string{"node-1"}) })
	pub2 := &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-2", VolumeCapability: mountCapability()}
	if _, err := ctrl.ControllerPublishVolume(ctx, pub2); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("publish to a second node: %v; want FailedPrecondition", err)
	}

	lr, err := ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range lr.Entries {
		ids = append(ids, e.Volume.VolumeId)
		if e.Volume.VolumeId == id && !slices.Equal(e.Status.PublishedNodeIds, []string{"node-1"}) {
			t.Errorf("listed mirror published to %v", e.Status.PublishedNodeIds)
		}
	}
	if !slices.Equal(ids, []string{single.Volume.VolumeId, id}) {
		t.Errorf("ListVolumes: %v; want %s and %s", ids, single.Volume.VolumeId, id)
	}

	// A copy's target down: unpublish fails, and fences nothing twice.
	b.down = true
	unpub := &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"}
	if _, err := ctrl.ControllerUnpublishVolume(ctx, unpub); status.Code(err) != codes.Unavailable {
		t.Errorf("unpublish with a copy's target down: %v; want Unavailable", err)
	}
	b.down = false
	if _, err := ctrl.ControllerUnpublishVolume(ctx, unpub); err != nil {
		t.Fatal(err)
	}
	both("unpublished", func(v *managepb.Volume) bool { return len(v.Hosts) == 0 })
	if _, err := ctrl.ControllerUnpublishVolume(ctx, unpub); err != nil {
		t.Errorf("unpublish again: %v", err)
	}

	er, err := ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20},
		VolumeCapability: blockCap()})
	if err != nil {
		t.Fatal(err)
	}
	if er.CapacityBytes != 128<<20 || !er.NodeExpansionRequired {
		t.Errorf("expand: %v; want 128 MiB and the node's expansion (the array), even for a block volume", er)
	}
	both("expanded", func(v *managepb.Volume) bool { return v.SizeBytes == 128<<20+mirror.DataOffset })

	if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
	if a.vols["fast/pvc-1"] != nil || b.vols["fast/pvc-1"] != nil {
		t.Error("a copy is left after DeleteVolume")
	}
	if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Errorf("delete again: %v", err)
	}
}
