package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rblk/rblk/admin"
	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/internal/sdnotify"
	"github.com/rblk/rblk/manage"
	"github.com/rblk/rblk/target"
)

// daemon is what rblkd serve runs beside the target: SIGHUP reloads of
// the configuration file and the admin socket.
type daemon struct {
	t           *target.Target
	svc         *manage.Service // the pools' volumes; nil without pools
	log         *zap.Logger
	file        fileState
	flagExports []target.ExportConfig

	// sem serializes reloads and admin commands (lock, unlock): a wait for
	// it ends with the waiter's context (at SIGTERM, or when the admin
	// client gives up).
	sem chan struct{}

	reloads    *prometheus.CounterVec
	lastReload prometheus.Gauge
	requests   *prometheus.CounterVec

	srv    *admin.Server
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// startDaemon starts the SIGHUP handler and the admin socket (unless
// f.adminSocket is ""). A socket in use by another rblkd is an error when
// it was asked for, else a warning.
func startDaemon(ctx context.Context, t *target.Target, svc *manage.Service, f serveFlags, flagExports []target.ExportConfig,
	reg prometheus.Registerer, log *zap.Logger) (*daemon, error) {
	d := &daemon{t: t, svc: svc, log: log, file: f.file, flagExports: flagExports, sem: make(chan struct{}, 1),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "rblkd", Name: "config_reloads_total",
			Help: "Reloads of the configuration file (SIGHUP or rblkd export reload), by result: ok or error."}, []string{"result"}),
		lastReload: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "rblkd", Name: "config_last_reload_success_timestamp_seconds",
			Help: "When the configuration was last loaded successfully (at start or by a reload), in Unix seconds."}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "rblkd", Name: "admin_requests_total",
			Help: "Requests on the admin socket, by command and result: ok or error."}, []string{"command", "result"}),
	}
	d.reloads.WithLabelValues("ok")
	d.reloads.WithLabelValues("error")
	d.lastReload.SetToCurrentTime()
	if reg != nil {
		for _, c := range []prometheus.Collector{d.reloads, d.lastReload, d.requests} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register metrics: %w", err)
			}
		}
	}
	if f.adminSocket != "" {
		srv, err := admin.Listen(f.adminSocket, d.handle, admin.ServerOptions{Logger: log})
		switch {
		case err == nil:
			d.srv = srv
			log.Info("admin socket", zap.String("path", srv.Path()))
		case errors.Is(err, admin.ErrInUse) && !f.file.adminSocketSet:
			log.Warn("admin socket in use by another rblkd: running without one (give --admin-socket PATH)", zap.Error(err))
		default:
			return nil, fmt.Errorf("--admin-socket: %w", err)
		}
	}
	ctx, d.cancel = context.WithCancel(ctx)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		defer signal.Stop(hup)
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				if d.file.path == "" {
					log.Warn("SIGHUP: rblkd has no --config to reload")
					continue
				}
				log.Info("SIGHUP: reloading the configuration", zap.String("config", d.file.path))
				// systemd (Type=notify) shows the unit reloading until
				// READY=1, sent whether the reload applied or was refused.
				notify(ctx, log, sdnotify.Reloading(ctx))
				if err := d.lock(ctx); err != nil {
					return // stopping
				}
				msg, err := d.reload(ctx) // (it logs what it did and what it refused)
				d.unlock()
				notify(ctx, log, sdnotify.Send(ctx, "READY=1\nSTATUS="+strings.ReplaceAll(reloadStatus(msg, err), "\n", "; ")))
			}
		}
	}()
	return d, nil
}

// lock takes the daemon's lock, or fails when ctx ends first.
func (d *daemon) lock(ctx context.Context) error {
	select {
	case d.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for another admin command or reload to finish: %w", ctx.Err())
	}
}

func (d *daemon) unlock() { <-d.sem }

// reloadStatus is what a reload did or why not, for systemd's STATUS=
// and the admin client.
func reloadStatus(msg string, err error) string {
	switch {
	case err == nil:
		return "reloaded: " + msg
	case refused(err):
		return "reload refused, nothing changed: " + err.Error()
	}
	return "reload incomplete: done: " + msg + "; not done: " + err.Error()
}

// stop closes the admin socket (ending the requests in progress) and the
// SIGHUP handler.
func (d *daemon) stop() {
	if d.srv != nil {
		d.srv.Close()
	}
	d.cancel()
	d.wg.Wait()
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// handle serves one admin request.
func (d *daemon) handle(ctx context.Context, req admin.Request) (resp admin.Response) {
	start := time.Now()
	defer func() {
		result := "ok"
		if !resp.OK {
			result = "error"
		}
		d.requests.WithLabelValues(req.Command, result).Inc()
		log := d.log.Info
		if !resp.OK {
			log = d.log.Warn
		}
		name := req.Name
		if req.Export != nil {
			name = req.Export.Name
		}
		fields := []zap.Field{zap.String("command", req.Command), zap.String("name", name)}
		if req.Pool != "" {
			fields = append(fields, zap.String("pool", req.Pool))
		}
		if req.Host != "" {
			fields = append(fields, zap.String("host_id", req.Host))
		}
		log("admin request", append(fields, zap.Bool("save", req.Save),
			zap.Bool("ok", resp.OK), zap.String("error", resp.Error), zap.Duration("took", time.Since(start)))...)
	}()
	if isVolumeCommand(req.Command) {
		return d.handleVolume(ctx, req) // (each volume has its own lock: not the reloads')
	}
	if req.Save && d.file.path == "" {
		return fail(errors.New("--save: rblkd was started without --config: there is no file to write the change to"))
	}
	switch req.Command {
	case admin.CmdList:
		return admin.Response{OK: true, Exports: exportList(d.t.Exports())}
	case admin.CmdReload:
		if d.file.path == "" {
			return fail(errors.New("reload: rblkd was started without --config"))
		}
	case admin.CmdAdd, admin.CmdRemove, admin.CmdGrow:
	default:
		return fail(fmt.Errorf("unknown command %q: want list, add, remove, grow, reload, pools, volumes, create, delete, expand, publish or unpublish", req.Command))
	}
	if req.Command == admin.CmdAdd {
		return d.add(ctx, req) // (it opens the file before it waits for the lock)
	}
	if err := d.lock(ctx); err != nil {
		return fail(err)
	}
	defer d.unlock()
	switch req.Command {
	case admin.CmdReload:
		msg, err := d.reload(ctx)
		if err != nil {
			return admin.Response{Error: reloadStatus(msg, err), Message: msg}
		}
		return admin.Response{OK: true, Message: msg}
	case admin.CmdRemove:
		return d.remove(ctx, req)
	default:
		return d.grow(ctx, req)
	}
}

// An admin command is a transaction too: it checks the request, edits the
// file (with --save) and stages it, and opens the export's file (add),
// before it changes anything; then it makes the change, and last puts the
// staged file in place (a rename). A refusal changes nothing.

// add serves a new export. Its file is opened first, before it waits for
// the lock: a file that is not one to export (a FIFO, a socket, a device,
// a mistyped path) is refused at once, even while another command (a
// removal draining its sessions) holds the lock.
func (d *daemon) add(ctx context.Context, req admin.Request) admin.Response {
	if req.Export == nil {
		return fail(errors.New("add: no export given"))
	}
	x := req.Export
	e := target.ExportConfig{Name: x.Name, Path: x.Path, Size: x.Size, ReadOnly: x.ReadOnly, Shared: x.Shared, Allow: x.Allow, Private: x.Private}
	exists := func() bool { return d.status(e.Name) != nil }
	if exists() { // (checked again under the lock; this one spares creating a file)
		return fail(fmt.Errorf("add export %q: %w", e.Name, target.ErrExportExists))
	}
	p, err := d.t.PrepareExport(ctx, e)
	if err != nil {
		return fail(fmt.Errorf("add export: %w", err))
	}
	defer p.Discard() // (nothing once added)
	if err := d.lock(ctx); err != nil {
		return fail(fmt.Errorf("add export %q: %w", e.Name, err))
	}
	defer d.unlock()
	if exists() {
		return fail(fmt.Errorf("add export %q: %w", e.Name, target.ErrExportExists))
	}
	staged, err := d.stage(req, func(c *config.Config) error {
		c.AddExport(e)
		return nil
	})
	if err != nil {
		return fail(err)
	}
	if err := d.t.AddPrepared(ctx, p); err != nil {
		staged.Abort()
		return fail(err)
	}
	return d.commit(staged, fmt.Sprintf("export %q added", e.Name))
}

// remove drains and removes an export.
func (d *daemon) remove(ctx context.Context, req admin.Request) admin.Response {
	if d.status(req.Name) == nil {
		return fail(fmt.Errorf("remove export %q: %w", req.Name, target.ErrNoExport))
	}
	staged, err := d.stage(req, func(c *config.Config) error {
		if !c.RemoveExport(req.Name) {
			return fmt.Errorf("export %q is not in %s", req.Name, c.Path)
		}
		return nil
	})
	if err != nil {
		return fail(err)
	}
	if err := d.t.RemoveExport(ctx, req.Name); err != nil {
		staged.Abort()
		return fail(err)
	}
	return d.commit(staged, fmt.Sprintf("export %q removed", req.Name))
}

// grow enlarges a volume.
func (d *daemon) grow(ctx context.Context, req admin.Request) admin.Response {
	cur := d.status(req.Name)
	switch {
	case cur == nil:
		return fail(fmt.Errorf("grow export %q: %w", req.Name, target.ErrNoExport))
	case req.Size <= 0:
		return fail(fmt.Errorf("grow export %q: size %d: want a size in bytes above 0", req.Name, req.Size))
	case uint64(req.Size) < cur.Size:
		return fail(fmt.Errorf("grow export %q: size %d is smaller than the volume's %d bytes: %w", req.Name, req.Size, cur.Size, target.ErrShrink))
	}
	staged, err := d.stage(req, func(c *config.Config) error {
		if !c.SetExportSize(req.Name, req.Size) {
			return fmt.Errorf("export %q is not in %s", req.Name, c.Path)
		}
		return nil
	})
	if err != nil {
		return fail(err)
	}
	if uint64(req.Size) > cur.Size {
		if err := d.t.Grow(ctx, req.Name, req.Size); err != nil {
			staged.Abort()
			return fail(fmt.Errorf("grow export %q: %w", req.Name, err))
		}
	}
	return d.commit(staged, fmt.Sprintf("export %q is %d bytes", req.Name, req.Size))
}

// fail is the response to a request refused (or failed) with err.
func fail(err error) admin.Response { return admin.Response{Error: err.Error()} }

// status is the running export name, or nil.
func (d *daemon) status(name string) *target.ExportStatus {
	for _, st := range d.t.Exports() {
		if st.Config.Name == name {
			return &st
		}
	}
	return nil
}

// stage, for a request with --save, reads the file again (edits made by
// hand meanwhile stay), edits it and stages it (written beside the file,
// synced); nil without --save. An edit that does not apply refuses the
// request, before anything changed.
func (d *daemon) stage(req admin.Request, edit func(*config.Config) error) (*config.Staged, error) {
	if !req.Save {
		return nil, nil
	}
	c, err := config.Load(d.file.path)
	if err == nil {
		err = edit(c)
	}
	var staged *config.Staged
	if err == nil {
		staged, err = c.Stage()
	}
	if err != nil {
		return nil, fmt.Errorf("--save: %w: nothing changed", err)
	}
	return staged, nil
}

// commit answers a request that was done: with --save, once the staged
// file is in place.
func (d *daemon) commit(staged *config.Staged, msg string) admin.Response {
	if staged == nil {
		return admin.Response{OK: true, Message: msg}
	}
	if err := staged.Commit(); err != nil {
		return admin.Response{Error: fmt.Sprintf("%s, but not saved: %v", msg, err), Message: msg}
	}
	return admin.Response{OK: true, Message: msg + ", saved to " + d.file.path}
}

// exportList is the admin form of st.
func exportList(st []target.ExportStatus) []admin.Export {
	out := make([]admin.Export, 0, len(st))
	for _, s := range st {
		allow := s.Config.Allow
		if allow == nil {
			allow = []string{}
		}
		out = append(out, admin.Export{Name: s.Config.Name, Path: s.Config.Path, Size: int64(s.Size), ConfiguredSize: s.Config.Size,
			ReadOnly: s.Config.ReadOnly, Shared: s.Config.Shared, Allow: allow, Private: s.Config.Private, Sessions: s.Sessions, Writers: s.Writers,
			BlockDevice: s.BlockDevice})
	}
	return out
}

// notify logs a failure to tell systemd about a reload; it never fails
// the reload.
func notify(ctx context.Context, log *zap.Logger, err error) {
	if err != nil && ctx.Err() == nil {
		log.Warn("cannot tell systemd about the reload", zap.Error(err))
	}
}
