package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
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
	"github.com/rblk/rblk/target"
)

// daemon is what rblkd serve runs beside the target: SIGHUP reloads of
// the configuration file and the admin socket.
type daemon struct {
	t           *target.Target
	log         *zap.Logger
	file        fileState
	flagExports []target.ExportConfig

	// mu serializes reloads and admin commands.
	mu sync.Mutex

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
func startDaemon(ctx context.Context, t *target.Target, f serveFlags, flagExports []target.ExportConfig,
	reg prometheus.Registerer, log *zap.Logger) (*daemon, error) {
	d := &daemon{t: t, log: log, file: f.file, flagExports: flagExports,
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
				d.mu.Lock()
				msg, err := d.reload(ctx) // (it logs what it did and what it refused)
				d.mu.Unlock()
				status := "reloaded: " + msg
				if err != nil {
					status = "reload refused, running configuration kept: " + err.Error()
				}
				notify(ctx, log, sdnotify.Send(ctx, "READY=1\nSTATUS="+strings.ReplaceAll(status, "\n", "; ")))
			}
		}
	}()
	return d, nil
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

// reload loads the file and makes the exports those of the file (with
// --export's over them): added ones are opened, removed ones drained,
// changed ones updated (allow, shared, a larger size) or, for a new path
// or read_only, removed and added again; unchanged ones are not touched.
// Other settings need a restart: a change is logged and the running value
// kept. An invalid file, or a smaller size, changes nothing. d.mu is held.
func (d *daemon) reload(ctx context.Context) (msg string, err error) {
	defer func() {
		if err != nil {
			d.reloads.WithLabelValues("error").Inc()
			d.log.Error("reload refused or incomplete: the running configuration stays (where not said otherwise)",
				zap.String("config", d.file.path), zap.Error(err))
			return
		}
		d.reloads.WithLabelValues("ok").Inc()
		d.lastReload.SetToCurrentTime()
		d.log.Info("reloaded", zap.String("config", d.file.path), zap.String("changes", msg))
	}()
	c, err := config.Load(d.file.path)
	if err != nil {
		return "", err
	}
	settings, err := fileSettings(c, d.file.cmdline)
	if err != nil {
		return "", err
	}
	want := mergeExports(c.ExportConfigs(), d.flagExports)
	current := map[string]target.ExportStatus{}
	for _, st := range d.t.Exports() {
		current[st.Config.Name] = st
	}
	// Check first what would be refused, so that a refused file changes
	// nothing.
	for _, e := range want {
		cur, ok := current[e.Name]
		if ok && e.Path == cur.Config.Path && e.ReadOnly == cur.Config.ReadOnly && e.Size != cur.Config.Size &&
			e.Size > 0 && uint64(e.Size) < cur.Size {
			line := 0
			for _, fe := range c.Exports {
				if fe.Name == e.Name {
					line = fe.Line
				}
			}
			return "", fmt.Errorf("%s:%d: export %q: size %d is smaller than the volume's %d bytes: %w", c.Path, line, e.Name, e.Size, cur.Size, target.ErrShrink)
		}
	}
	var changes []string
	var errs []error
	for _, key := range sortedKeys(settings) {
		if settings[key] != d.file.running[key] {
			d.log.Warn("setting changed in the configuration needs a restart: keeping the running value",
				zap.String("setting", key), zap.String("running", d.file.running[key]), zap.String("file", settings[key]))
			changes = append(changes, key+" needs a restart")
		}
	}
	wanted := map[string]target.ExportConfig{}
	for _, e := range want {
		wanted[e.Name] = e
	}
	for _, name := range sortedKeys(current) {
		if _, ok := wanted[name]; !ok {
			if err := d.t.RemoveExport(ctx, name); err != nil {
				errs = append(errs, err)
				continue
			}
			changes = append(changes, "removed "+name)
		}
	}
	for _, e := range want {
		cur, ok := current[e.Name]
		switch {
		case !ok:
			if err := d.t.AddExport(ctx, e); err != nil {
				errs = append(errs, err)
				continue
			}
			changes = append(changes, "added "+e.Name)
		case e.Path != cur.Config.Path || e.ReadOnly != cur.Config.ReadOnly:
			// Cannot change under its sessions: they are drained.
			if err := d.t.RemoveExport(ctx, e.Name); err != nil {
				errs = append(errs, err)
				continue
			}
			if err := d.t.AddExport(ctx, e); err != nil {
				errs = append(errs, fmt.Errorf("export %q was removed to change its path or read_only, and could not be added again: %w", e.Name, err))
				continue
			}
			changes = append(changes, "replaced "+e.Name)
		case !slices.Equal(e.Allow, cur.Config.Allow) || e.Shared != cur.Config.Shared || e.Size != cur.Config.Size:
			if err := d.t.UpdateExport(ctx, e); err != nil {
				errs = append(errs, err)
				continue
			}
			changes = append(changes, "updated "+e.Name)
		}
	}
	msg = strings.Join(changes, ", ")
	if msg == "" {
		msg = "no change"
	}
	if err := errors.Join(errs...); err != nil {
		return msg, fmt.Errorf("%s: %w", d.file.path, err)
	}
	return msg, nil
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
		log("admin request", zap.String("command", req.Command), zap.String("name", name), zap.Bool("save", req.Save),
			zap.Bool("ok", resp.OK), zap.String("error", resp.Error), zap.Duration("took", time.Since(start)))
	}()
	fail := func(err error) admin.Response { return admin.Response{Error: err.Error()} }
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
		return fail(fmt.Errorf("unknown command %q: want list, add, remove, grow or reload", req.Command))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	switch req.Command {
	case admin.CmdReload:
		msg, err := d.reload(ctx)
		if err != nil {
			return admin.Response{Error: err.Error(), Message: msg}
		}
		return admin.Response{OK: true, Message: msg}
	case admin.CmdAdd:
		if req.Export == nil {
			return fail(errors.New("add: no export given"))
		}
		x := req.Export
		e := target.ExportConfig{Name: x.Name, Path: x.Path, Size: x.Size, ReadOnly: x.ReadOnly, Shared: x.Shared, Allow: x.Allow}
		if err := d.t.AddExport(ctx, e); err != nil {
			return fail(err)
		}
		return d.saved(req, fmt.Sprintf("export %q added", e.Name), func(c *config.Config) error {
			c.AddExport(e)
			return nil
		})
	case admin.CmdRemove:
		if err := d.t.RemoveExport(ctx, req.Name); err != nil {
			return fail(err)
		}
		return d.saved(req, fmt.Sprintf("export %q removed", req.Name), func(c *config.Config) error {
			if !c.RemoveExport(req.Name) {
				return fmt.Errorf("export %q is not in %s", req.Name, c.Path)
			}
			return nil
		})
	default: // grow
		var cur *target.ExportStatus
		for _, st := range d.t.Exports() {
			if st.Config.Name == req.Name {
				cur = &st
			}
		}
		switch {
		case cur == nil:
			return fail(fmt.Errorf("grow export %q: %w", req.Name, target.ErrNoExport))
		case req.Size <= 0:
			return fail(fmt.Errorf("grow export %q: size %d: want a size in bytes above 0", req.Name, req.Size))
		case uint64(req.Size) < cur.Size:
			return fail(fmt.Errorf("grow export %q: size %d is smaller than the volume's %d bytes: %w", req.Name, req.Size, cur.Size, target.ErrShrink))
		case uint64(req.Size) > cur.Size:
			if err := d.t.Grow(ctx, req.Name, req.Size); err != nil {
				return fail(fmt.Errorf("grow export %q: %w", req.Name, err))
			}
		}
		return d.saved(req, fmt.Sprintf("export %q is %d bytes", req.Name, req.Size), func(c *config.Config) error {
			if !c.SetExportSize(req.Name, req.Size) {
				return fmt.Errorf("export %q is not in %s", req.Name, c.Path)
			}
			return nil
		})
	}
}

// saved answers a request that was done: with req.Save, after edit wrote
// the change to the file (read again: edits made by hand meanwhile stay).
func (d *daemon) saved(req admin.Request, msg string, edit func(*config.Config) error) admin.Response {
	if !req.Save {
		return admin.Response{OK: true, Message: msg}
	}
	c, err := config.Load(d.file.path)
	if err == nil {
		err = edit(c)
	}
	if err == nil {
		err = c.Save()
	}
	if err != nil {
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
			ReadOnly: s.Config.ReadOnly, Shared: s.Config.Shared, Allow: allow, Sessions: s.Sessions, Writers: s.Writers,
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
