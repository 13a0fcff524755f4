package remote

import (
	"context"

	"github.com/rblk/rblk/manage"
	"github.com/rblk/rblk/manage/managepb"
)

// handlers serve managepb.Manage through the Service, after the pool check.
type handlers struct {
	managepb.UnimplementedManageServer
	svc *manage.Service
	s   *Server
}

func volumePB(v manage.Volume) *managepb.Volume {
	return &managepb.Volume{Pool: v.Pool, Name: v.Name, Export: v.Export, SizeBytes: v.Size, AllocatedBytes: v.Allocated,
		Shared: v.Shared, Hosts: v.Hosts, Sessions: int32(v.Sessions), Writers: int32(v.Writers), Labels: v.Labels, CreatedUnix: v.Created.Unix()}
}

func (h *handlers) ListPools(ctx context.Context, req *managepb.ListPoolsRequest) (*managepb.ListPoolsResponse, error) {
	if req.Pool != "" {
		if err := h.s.check(ctx, req.Pool); err != nil {
			return nil, err
		}
	}
	ps, err := h.svc.Pools(req.Pool)
	if err != nil {
		return nil, toStatus(err)
	}
	out := &managepb.ListPoolsResponse{}
	for _, p := range ps {
		if !h.s.may(ctx, p.Name) {
			continue
		}
		out.Pools = append(out.Pools, &managepb.Pool{Name: p.Name, Labels: p.Labels, CapacityBytes: p.Limit, ProvisionedBytes: p.Provisioned,
			AllocatedBytes: p.Allocated, AvailableBytes: p.Available, Volumes: int32(p.Volumes), Damaged: int32(p.Damaged)})
	}
	return out, nil
}

func (h *handlers) CreateVolume(ctx context.Context, req *managepb.CreateVolumeRequest) (*managepb.CreateVolumeResponse, error) {
	if err := h.s.check(ctx, req.Pool); err != nil {
		return nil, err
	}
	v, created, err := h.svc.Create(ctx, req.Pool, req.Name, req.SizeBytes, req.Shared)
	if err != nil {
		return nil, toStatus(err)
	}
	return &managepb.CreateVolumeResponse{Volume: volumePB(v), Created: created}, nil
}

func (h *handlers) DeleteVolume(ctx context.Context, req *managepb.DeleteVolumeRequest) (*managepb.DeleteVolumeResponse, error) {
	if err := h.s.check(ctx, req.Pool); err != nil {
		return nil, err
	}
	if err := h.svc.Delete(ctx, req.Pool, req.Name); err != nil {
		return nil, toStatus(err)
	}
	return &managepb.DeleteVolumeResponse{}, nil
}

func (h *handlers) ExpandVolume(ctx context.Context, req *managepb.ExpandVolumeRequest) (*managepb.ExpandVolumeResponse, error) {
	if err := h.s.check(ctx, req.Pool); err != nil {
		return nil, err
	}
	v, err := h.svc.Expand(ctx, req.Pool, req.Name, req.SizeBytes)
	if err != nil {
		return nil, toStatus(err)
	}
	return &managepb.ExpandVolumeResponse{Volume: volumePB(v)}, nil
}

func (h *handlers) GetVolume(ctx context.Context, req *managepb.GetVolumeRequest) (*managepb.GetVolumeResponse, error) {
	if err := h.s.check(ctx, req.Pool); err != nil {
		return nil, err
	}
	v, err := h.svc.Get(req.Pool, req.Name)
	if err != nil {
		return nil, toStatus(err)
	}
	return &managepb.GetVolumeResponse{Volume: volumePB(v)}, nil
}

func (h *handlers) ListVolumes(ctx context.Context, req *managepb.ListVolumesRequest) (*managepb.ListVolumesResponse, error) {
	if req.Pool != "" {
		if err := h.s.check(ctx, req.Pool); err != nil {
			return nil, err
		}
	}
	vols, err := h.svc.List(req.Pool)
	if err != nil {
		return nil, toStatus(err)
	}
	out := &managepb.ListVolumesResponse{}
	for _, v := range vols {
		if h.s.may(ctx, v.Pool) {
			out.Volumes = append(out.Volumes, volumePB(v))
		}
	}
	return out, nil
}

func (h *handlers) PublishVolume(ctx context.Context, req *managepb.PublishVolumeRequest) (*managepb.PublishVolumeResponse, error) {
	if err := h.s.check(ctx, req.Pool); err != nil {
		return nil, err
	}
	v, err := h.svc.Publish(ctx, req.Pool, req.Name, req.HostId)
	if err != nil {
		return nil, toStatus(err)
	}
	return &managepb.PublishVolumeResponse{Volume: volumePB(v)}, nil
}

func (h *handlers) UnpublishVolume(ctx context.Context, req *managepb.UnpublishVolumeRequest) (*managepb.UnpublishVolumeResponse, error) {
	if err := h.s.check(ctx, req.Pool); err != nil {
		return nil, err
	}
	n, err := h.svc.Unpublish(ctx, req.Pool, req.Name, req.HostId)
	if err != nil {
		return nil, toStatus(err)
	}
	return &managepb.UnpublishVolumeResponse{SessionsFenced: int32(n)}, nil
}
