package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/rblk/rblk/admin"
	"github.com/rblk/rblk/manage"
)

// isVolumeCommand reports whether cmd is about the pools' volumes.
func isVolumeCommand(cmd string) bool {
	switch cmd {
	case admin.CmdPools, admin.CmdVolumes, admin.CmdCreate, admin.CmdDelete, admin.CmdExpand, admin.CmdPublish, admin.CmdUnpublish:
		return true
	}
	return false
}

// errNoPools answers a volume command of an rblkd without pools.
var errNoPools = errors.New("rblkd has no pools: configure pools: in its --config (see README, Storage pools)")

// handleVolume serves a volume command through the Service, the same
// handlers as the remote management API.
func (d *daemon) handleVolume(ctx context.Context, req admin.Request) admin.Response {
	if d.svc == nil {
		return failCode(errNoPools)
	}
	if req.Save {
		return failCode(fmt.Errorf("%s: --save: a pool's volumes are recorded in the pool, not in the configuration file: %w", req.Command, manage.ErrInvalid))
	}
	switch req.Command {
	case admin.CmdPools:
		ps, err := d.svc.Pools(req.Pool)
		if err != nil {
			return failCode(err)
		}
		resp := admin.Response{OK: true, Pools: []admin.Pool{}}
		for _, p := range ps {
			resp.Pools = append(resp.Pools, admin.Pool{Name: p.Name, Labels: p.Labels, Capacity: p.Limit, Provisioned: p.Provisioned,
				Allocated: p.Allocated, Available: p.Available, Volumes: p.Volumes, Damaged: p.Damaged})
		}
		return resp
	case admin.CmdVolumes:
		vols, err := d.svc.List(req.Pool)
		if err != nil {
			return failCode(err)
		}
		return admin.Response{OK: true, Volumes: adminVolumes(vols...)}
	case admin.CmdCreate:
		v, created, err := d.svc.Create(ctx, req.Pool, req.Name, req.Size, req.Shared)
		if err != nil {
			return failCode(err)
		}
		msg := fmt.Sprintf("volume %q created in pool %q: export %q, %d bytes", v.Name, v.Pool, v.Export, v.Size)
		if !created {
			msg = fmt.Sprintf("volume %q exists in pool %q as asked: export %q, %d bytes", v.Name, v.Pool, v.Export, v.Size)
		}
		return admin.Response{OK: true, Message: msg, Volumes: adminVolumes(v), Created: created}
	case admin.CmdDelete:
		if err := d.svc.Delete(ctx, req.Pool, req.Name); err != nil {
			return failCode(err)
		}
		return admin.Response{OK: true, Message: fmt.Sprintf("volume %q of pool %q deleted", req.Name, req.Pool)}
	case admin.CmdExpand:
		v, err := d.svc.Expand(ctx, req.Pool, req.Name, req.Size)
		if err != nil {
			return failCode(err)
		}
		return admin.Response{OK: true, Message: fmt.Sprintf("volume %q of pool %q is %d bytes", v.Name, v.Pool, v.Size), Volumes: adminVolumes(v)}
	case admin.CmdPublish:
		v, err := d.svc.Publish(ctx, req.Pool, req.Name, req.Host)
		if err != nil {
			return failCode(err)
		}
		return admin.Response{OK: true, Message: fmt.Sprintf("volume %q of pool %q published to host %q", v.Name, v.Pool, req.Host), Volumes: adminVolumes(v)}
	default: // unpublish
		n, err := d.svc.Unpublish(ctx, req.Pool, req.Name, req.Host)
		if err != nil {
			return failCode(err)
		}
		return admin.Response{OK: true, Fenced: n,
			Message: fmt.Sprintf("volume %q of pool %q unpublished from host %q: %d sessions fenced", req.Name, req.Pool, req.Host, n)}
	}
}

// failCode is fail with the error's code.
func failCode(err error) admin.Response {
	return admin.Response{Error: err.Error(), Code: string(manage.CodeOf(err))}
}

// adminVolumes is the admin form of vols.
func adminVolumes(vols ...manage.Volume) []admin.Volume {
	out := make([]admin.Volume, 0, len(vols))
	for _, v := range vols {
		out = append(out, admin.Volume{Pool: v.Pool, Name: v.Name, Export: v.Export, Path: v.Path, Size: v.Size, Allocated: v.Allocated,
			Shared: v.Shared, Hosts: v.Hosts, Sessions: v.Sessions, Writers: v.Writers, Labels: v.Labels, Created: v.Created})
	}
	return out
}
