package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
)

// A reload is a transaction: it reads and checks the whole file, opens
// every file it adds or changes, and checks that each file is one export,
// before it changes anything; anything wrong refuses the reload and
// nothing changes. Then it applies, in this order: the adds of files no
// export serves (their files are open: they cannot fail but for a
// shutdown), the removes (a removal whose write-back fails keeps its
// export, as RemoveExport says), the adds that wait for a removal (a
// replaced export, or a file that moves from one export to another: done
// only if that removal was), and the updates. What was done and what was
// not is reported, and the running exports are always a consistent set:
// each export either as it was or as the file says.

// errNoExports refuses a file that configures no exports where rblkd
// serves some of it: a half-written file (truncated, or still empty)
// must not remove every export.
var errNoExports = errors.New("configures no exports: refusing to remove every export (is the file half-written?)")

// refusedError is a reload refused before it changed anything.
type refusedError struct{ err error }

func (e *refusedError) Error() string { return e.err.Error() }
func (e *refusedError) Unwrap() error { return e.err }

// refused reports whether err refused the reload (nothing changed), as
// opposed to a reload applied in part.
func refused(err error) bool {
	var r *refusedError
	return errors.As(err, &r)
}

// change is an export a reload opens: a new name, or a replaced export
// (its path or read_only changed).
type change struct {
	cfg     target.ExportConfig
	replace bool
}

// plan is what makes the running exports those wanted, by name.
type plan struct {
	remove []string              // exports not wanted, by name
	open   []change              // new and replaced exports, in the order wanted
	update []target.ExportConfig // allow, shared or size changed
}

// shrinkError is a size smaller than the volume's.
type shrinkError struct {
	name       string
	size       int64
	volumeSize uint64
}

func (e *shrinkError) Error() string {
	return fmt.Sprintf("export %q: size %d is smaller than the volume's %d bytes: %v", e.name, e.size, e.volumeSize, target.ErrShrink)
}
func (e *shrinkError) Unwrap() error { return target.ErrShrink }

// planReload compares the running exports with those wanted, without IO:
// names not wanted are removed, new names added, a changed path or
// read_only replaces the export, a changed allow, shared or size updates
// it; an unchanged export has no step. A size smaller than the volume's is
// refused (a *shrinkError).
func planReload(current []target.ExportStatus, want []target.ExportConfig) (plan, error) {
	var p plan
	cur := map[string]target.ExportStatus{}
	for _, st := range current {
		cur[st.Config.Name] = st
	}
	wanted := map[string]bool{}
	for _, e := range want {
		wanted[e.Name] = true
		c, ok := cur[e.Name]
		switch {
		case !ok:
			p.open = append(p.open, change{cfg: e})
		case e.Path != c.Config.Path || e.ReadOnly != c.Config.ReadOnly:
			p.open = append(p.open, change{cfg: e, replace: true})
		case !slices.Equal(e.Allow, c.Config.Allow) || e.Shared != c.Config.Shared || e.Size != c.Config.Size:
			// (A size that did not change is not compared with the volume:
			// it may have grown past it since, online.)
			if e.Size != c.Config.Size && e.Size > 0 && uint64(e.Size) < c.Size {
				return plan{}, &shrinkError{name: e.Name, size: e.Size, volumeSize: c.Size}
			}
			p.update = append(p.update, e)
		}
	}
	for _, st := range current {
		if !wanted[st.Config.Name] {
			p.remove = append(p.remove, st.Config.Name)
		}
	}
	slices.Sort(p.remove)
	return p, nil
}

// opKind is what a step of a reload does.
type opKind int

const (
	opAdd    opKind = iota // serve an export whose file is open
	opRemove               // drain and remove an export
	opUpdate               // change an export live
)

// op is one step of a reload.
type op struct {
	kind opKind
	name string
	cfg  target.ExportConfig // opAdd, opUpdate
	// replace: the step is half of a replace (the export's path or
	// read_only changed): remove, then add again.
	replace bool
	// after (opAdd): the exports whose removal must be done first (they
	// serve the file, or hold the name).
	after []string
}

// schedule orders the steps of p, given the backing files of the running
// exports (current) and of the files opened for p.open (files, by name),
// without IO:
//   - one file is one export: a file an export keeps serving, or one that
//     two exports opened, is refused (target.ErrSameFile naming the
//     first);
//   - a replace whose new path is another name of the export's file, with
//     read_only unchanged, is an update (its sessions are not touched);
//   - an add waits for the removal of the export that holds its name (a
//     replace) and of one that serves its file (a file that moves to
//     another export: a rename).
//
// The order: the adds that wait for nothing, the removes, the adds that
// waited, the updates.
func schedule(current []target.ExportStatus, p plan, files map[string]target.FileID) ([]op, error) {
	cur := map[string]target.ExportStatus{}
	for _, st := range current {
		cur[st.Config.Name] = st
	}
	leaving := map[string]bool{}
	for _, n := range p.remove {
		leaving[n] = true
	}
	for _, c := range p.open {
		if c.replace {
			leaving[c.cfg.Name] = true
		}
	}
	staying := map[target.FileID]string{} // file -> export that keeps it
	moving := map[target.FileID]string{}  // file -> export that leaves it
	for _, st := range current {
		if leaving[st.Config.Name] {
			moving[st.File] = st.Config.Name
		} else {
			staying[st.File] = st.Config.Name
		}
	}
	var first, removes, late, updates []op
	opened := map[target.FileID]string{}
	repath := map[string]bool{}
	for _, c := range p.open {
		e := c.cfg
		id, ok := files[e.Name]
		if !ok {
			return nil, fmt.Errorf("export %q: its file was not opened (a bug)", e.Name)
		}
		if o, ok := staying[id]; ok {
			return nil, fmt.Errorf("export %q: %s is %w %q (%s)", e.Name, e.Path, target.ErrSameFile, o, cur[o].Config.Path)
		}
		if o, ok := opened[id]; ok {
			return nil, fmt.Errorf("export %q: %s is %w %q (%s)", e.Name, e.Path, target.ErrSameFile, o, pathOf(p.open, o))
		}
		opened[id] = e.Name
		if c.replace && cur[e.Name].File == id && cur[e.Name].Config.ReadOnly == e.ReadOnly {
			// Another name of the same file: an update.
			if e.Size != cur[e.Name].Config.Size && e.Size > 0 && uint64(e.Size) < cur[e.Name].Size {
				return nil, &shrinkError{name: e.Name, size: e.Size, volumeSize: cur[e.Name].Size}
			}
			repath[e.Name] = true
			updates = append(updates, op{kind: opUpdate, name: e.Name, cfg: e})
			continue
		}
		var after []string
		if c.replace {
			after = append(after, e.Name)
		}
		if o, ok := moving[id]; ok && o != e.Name {
			after = append(after, o)
		}
		if len(after) == 0 {
			first = append(first, op{kind: opAdd, name: e.Name, cfg: e})
		} else {
			late = append(late, op{kind: opAdd, name: e.Name, cfg: e, replace: c.replace, after: after})
		}
	}
	for _, n := range p.remove {
		removes = append(removes, op{kind: opRemove, name: n})
	}
	for _, c := range p.open {
		if c.replace && !repath[c.cfg.Name] {
			removes = append(removes, op{kind: opRemove, name: c.cfg.Name, replace: true})
		}
	}
	for _, e := range p.update {
		updates = append(updates, op{kind: opUpdate, name: e.Name, cfg: e})
	}
	return slices.Concat(first, removes, late, updates), nil
}

// pathOf is the path of export name among changes.
func pathOf(changes []change, name string) string {
	for _, c := range changes {
		if c.cfg.Name == name {
			return c.cfg.Path
		}
	}
	return ""
}

// reload loads the file and makes the exports those of the file (with
// --export's over them), as a transaction (see above). Other settings need
// a restart: a change is logged and the running value kept. It returns
// what it changed; its error is a *refusedError if nothing changed. The
// daemon's lock is held.
func (d *daemon) reload(ctx context.Context) (msg string, err error) {
	defer func() {
		switch {
		case err == nil:
			d.reloads.WithLabelValues("ok").Inc()
			d.lastReload.SetToCurrentTime()
			d.log.Info("reloaded", zap.String("config", d.file.path), zap.String("changes", msg))
		case refused(err):
			d.reloads.WithLabelValues("error").Inc()
			d.log.Error("reload refused: nothing changed, the running exports stay", zap.String("config", d.file.path), zap.Error(err))
		default:
			d.reloads.WithLabelValues("error").Inc()
			d.log.Error("reload incomplete: what could be done was, the rest stays as it was",
				zap.String("config", d.file.path), zap.String("changes", msg), zap.Error(err))
		}
	}()
	refuse := func(err error) (string, error) { return "", &refusedError{err: err} }
	c, err := config.Load(d.file.path)
	if err != nil {
		return refuse(err)
	}
	settings, err := fileSettings(c, d.file.cmdline)
	if err != nil {
		return refuse(err)
	}
	// where names the file and line of an export, or the command line.
	where := func(name string) string {
		for _, e := range c.Exports {
			if e.Name == name {
				return fmt.Sprintf("%s:%d", c.Path, e.Line)
			}
		}
		return "--export"
	}
	// The pools' volumes are the pools', not the file's: a reload does
	// not see them.
	current := slices.DeleteFunc(d.t.Exports(), func(st target.ExportStatus) bool { return d.svc != nil && d.svc.Owns(st.Config.Name) })
	want := mergeExports(c.ExportConfigs(), d.flagExports)
	if err := checkNamespaces(want, d.file.pools); err != nil {
		return refuse(err)
	}
	p, err := planReload(current, want)
	if err != nil {
		var se *shrinkError
		if errors.As(err, &se) {
			return refuse(fmt.Errorf("%s: %w", where(se.name), err))
		}
		return refuse(err)
	}
	if len(c.Exports) == 0 && ((len(want) == 0 && len(c.Pools) == 0) || len(p.remove) > 0) {
		return refuse(fmt.Errorf("%s %w", c.Path, errNoExports))
	}
	// A served export's path changed to one that does not exist: a typo
	// more likely than a wish for a new, empty file.
	for _, ch := range p.open {
		if _, err := os.Stat(ch.cfg.Path); ch.replace && errors.Is(err, fs.ErrNotExist) {
			return refuse(fmt.Errorf("%s: export %q: path %s does not exist: a reload does not create a new file for an export it serves "+
				"(mistyped? to serve the export from a new file, remove it and add it)", where(ch.cfg.Name), ch.cfg.Name, ch.cfg.Path))
		}
	}
	// Open every new file before anything changes.
	prepared := map[string]*target.PreparedExport{}
	discard := func() {
		for _, pe := range prepared {
			pe.Discard()
		}
	}
	var openErrs []error
	files := map[string]target.FileID{}
	for _, ch := range p.open {
		pe, err := d.t.PrepareExport(ctx, ch.cfg)
		if err != nil {
			openErrs = append(openErrs, fmt.Errorf("%s: %w", where(ch.cfg.Name), err))
			continue
		}
		prepared[ch.cfg.Name] = pe
		files[ch.cfg.Name] = pe.File()
	}
	if err := errors.Join(openErrs...); err != nil {
		discard()
		return refuse(err)
	}
	ops, err := schedule(current, p, files)
	if err != nil {
		discard()
		var se *shrinkError
		if errors.As(err, &se) {
			return refuse(fmt.Errorf("%s: %w", where(se.name), err))
		}
		return refuse(err)
	}

	// Apply.
	var changes []string
	for _, key := range sortedKeys(settings) {
		if settings[key] != d.file.running[key] {
			d.log.Warn("setting changed in the configuration needs a restart: keeping the running value",
				zap.String("setting", key), zap.String("running", d.file.running[key]), zap.String("file", settings[key]))
			changes = append(changes, key+" needs a restart")
		}
	}
	if !samePools(c.Pools, d.file.pools) {
		d.log.Warn("pools: changed in the configuration needs a restart: keeping the running pools")
		changes = append(changes, "pools needs a restart")
	}
	if !sameManagement(c.Management, d.file.management) {
		d.log.Warn("management: changed in the configuration needs a restart: keeping the running management API")
		changes = append(changes, "management needs a restart")
	}
	changes, errs := d.apply(ctx, ops, prepared, changes)
	discard() // those not added (after a failure)
	msg = strings.Join(changes, ", ")
	if msg == "" {
		msg = "no change"
	}
	if err := errors.Join(errs...); err != nil {
		return msg, fmt.Errorf("%s: %w", d.file.path, err)
	}
	return msg, nil
}

// apply runs the steps of a reload, adding what it did to changes; a step
// that fails is reported and leaves its export as it was (an add that
// waited for a removal that failed is not done). When ctx ends (rblkd is
// stopping), the steps left are not done.
func (d *daemon) apply(ctx context.Context, ops []op, prepared map[string]*target.PreparedExport, changes []string) ([]string, []error) {
	var errs []error
	removed := map[string]bool{}
	for i, o := range ops {
		if err := ctx.Err(); err != nil {
			var left []string
			for _, o := range ops[i:] {
				left = append(left, o.name)
			}
			errs = append(errs, fmt.Errorf("stopped before %s: %w", strings.Join(slices.Compact(left), ", "), err))
			break
		}
		switch o.kind {
		case opAdd:
			if i := slices.IndexFunc(o.after, func(n string) bool { return !removed[n] }); i >= 0 {
				if o.after[i] == o.name {
					errs = append(errs, fmt.Errorf("export %q not replaced: it could not be removed, and stays as it was", o.name))
				} else {
					errs = append(errs, fmt.Errorf("export %q not added: export %q, which serves its file, could not be removed", o.name, o.after[i]))
				}
				continue
			}
			if err := d.t.AddPrepared(ctx, prepared[o.name]); err != nil {
				if o.replace {
					err = fmt.Errorf("export %q was removed to change its path or read_only, and could not be added again: %w", o.name, err)
				}
				errs = append(errs, err)
				continue
			}
			if o.replace {
				changes = append(changes, "replaced "+o.name)
			} else {
				changes = append(changes, "added "+o.name)
			}
		case opRemove:
			if err := d.t.RemoveExport(ctx, o.name); err != nil {
				errs = append(errs, err) // (the export stays)
				continue
			}
			removed[o.name] = true
			if !o.replace {
				changes = append(changes, "removed "+o.name)
			}
		case opUpdate:
			if err := d.t.UpdateExport(ctx, o.cfg); err != nil {
				errs = append(errs, err)
				continue
			}
			changes = append(changes, "updated "+o.name)
		}
	}
	return changes, errs
}
