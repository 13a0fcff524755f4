package main

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
)

// fileState is what rblkd serve --config keeps of how it was configured,
// for reloads and --save.
type fileState struct {
	path string // the --config file; "" without one
	// cmdline are the flags given on the command line (name: value),
	// which override the file at start and at every reload.
	cmdline map[string]string
	// running are the settings (config.Keys) rblkd runs with.
	running map[string]string
	// fileExports are the exports of the file at start.
	fileExports []target.ExportConfig
	// pools are the storage pools of the file at start (a change needs a
	// restart).
	pools []config.Pool
	// management is the remote management API of the file at start (a
	// change needs a restart); nil: off.
	management *config.Management
	// adminSocketSet: --admin-socket or admin_socket was given (a socket
	// in use is then an error, not a warning).
	adminSocketSet bool
}

// loadConfig reads f.config (if given) into the flags not given on the
// command line, and records what reloads need.
func loadConfig(cmd *cobra.Command, f *serveFlags) error {
	fl := cmd.Flags()
	f.file = fileState{path: f.config, cmdline: map[string]string{}}
	fl.Visit(func(fg *pflag.Flag) {
		if fg.Name != "export" && fg.Name != "config" {
			f.file.cmdline[fg.Name] = fg.Value.String()
		}
	})
	f.file.adminSocketSet = fl.Changed("admin-socket")
	if f.config != "" {
		c, err := config.Load(f.config)
		if err != nil {
			return fmt.Errorf("--config: %w", err)
		}
		if err := applySettings(fl, c, f.file.cmdline); err != nil {
			return fmt.Errorf("--config: %w", err)
		}
		if _, ok := c.Setting("admin_socket"); ok {
			f.file.adminSocketSet = true
		}
		f.file.fileExports = c.ExportConfigs()
		f.file.pools = c.Pools
		f.file.management = c.Management
	}
	f.file.running = settingsOf(fl)
	return nil
}

// applySettings sets the flags of fl that cmdline does not name to the
// file's values.
func applySettings(fl *pflag.FlagSet, c *config.Config, cmdline map[string]string) error {
	for _, s := range c.Settings {
		name := config.FlagName(s.Key)
		if _, given := cmdline[name]; given {
			continue
		}
		fg := fl.Lookup(name)
		if fg == nil {
			return fmt.Errorf("%s:%d: %s: no flag --%s (a bug)", c.Path, s.Line, s.Key, name)
		}
		if err := fg.Value.Set(s.Value); err != nil {
			return &config.Error{File: c.Path, Line: s.Line, Field: s.Key, Msg: err.Error()}
		}
	}
	return nil
}

// settingsOf returns the values of the flags that the file's settings
// stand for.
func settingsOf(fl *pflag.FlagSet) map[string]string {
	out := map[string]string{}
	for key := range config.Keys {
		if fg := fl.Lookup(config.FlagName(key)); fg != nil {
			out[key] = fg.Value.String()
		}
	}
	return out
}

// fileSettings returns the settings rblkd would start with from c: the
// defaults, c's settings, the command line's flags over them.
func fileSettings(c *config.Config, cmdline map[string]string) (map[string]string, error) {
	fl := newServeCmd().Flags()
	for name, v := range cmdline {
		if fg := fl.Lookup(name); fg != nil {
			if err := fg.Value.Set(v); err != nil {
				return nil, fmt.Errorf("--%s: %w", name, err)
			}
		}
	}
	if err := applySettings(fl, c, cmdline); err != nil {
		return nil, err
	}
	return settingsOf(fl), nil
}

// mergeExports is the file's exports with those of --export over them (by
// name), then the --export ones the file does not have.
func mergeExports(file, flags []target.ExportConfig) []target.ExportConfig {
	out := slices.Clone(file)
	for _, e := range flags {
		if i := slices.IndexFunc(out, func(o target.ExportConfig) bool { return o.Name == e.Name }); i >= 0 {
			out[i] = e
		} else {
			out = append(out, e)
		}
	}
	return out
}

// checkNamespaces refuses an export whose name is a pool volume's,
// POOL:NAME of a pool of pools: those names are the pools'.
func checkNamespaces(exports []target.ExportConfig, pools []config.Pool) error {
	for _, e := range exports {
		for _, p := range pools {
			if strings.HasPrefix(e.Name, p.Name+":") {
				return fmt.Errorf("export %q: names of the form %s:NAME are pool %q's volumes: rename the export", e.Name, p.Name, p.Name)
			}
		}
	}
	return nil
}

// samePools reports whether a and b configure the same pools.
func samePools(a, b []config.Pool) bool {
	return slices.EqualFunc(a, b, func(x, y config.Pool) bool {
		return x.Name == y.Name && x.Directory == y.Directory && x.Capacity == y.Capacity && maps.Equal(x.Labels, y.Labels)
	})
}

// sameManagement reports whether a and b configure the same management
// API (where they stand in the file aside).
func sameManagement(a, b *config.Management) bool {
	if a == nil || b == nil {
		return a == b
	}
	x, y := *a, *b
	x.Line, y.Line = 0, 0
	return reflect.DeepEqual(x, y)
}
