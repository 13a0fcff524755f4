package main

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
)

// TestLoadConfig: the file fills the flags the command line did not
// give; a reload sees what changed in the file, not what the command line
// fixed.
func TestLoadConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rblkd.yaml")
	if err := os.WriteFile(path, []byte("cache_size: 1G\nchunk_size: 256K\ndrain_timeout: 3s\nexports:\n  - name: v\n    path: /v\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := newServeCmd()
	if err := cmd.ParseFlags([]string{"--config", path, "--cache-size", "64M", "--export", "w=/w,ro"}); err != nil {
		t.Fatal(err)
	}
	var f serveFlags
	// (the command's RunE holds its own serveFlags: read the flags back)
	f.config = path
	if err := loadConfig(cmd, &f); err != nil {
		t.Fatal(err)
	}
	fl := cmd.Flags()
	for name, want := range map[string]string{"cache-size": "64M", "chunk-size": "256K", "drain-timeout": "3s", "revoke-timeout": "10s"} {
		if got := fl.Lookup(name).Value.String(); got != want {
			t.Errorf("--%s = %s, want %s", name, got, want)
		}
	}
	if want := []target.ExportConfig{{Name: "v", Path: "/v"}}; !reflect.DeepEqual(f.file.fileExports, want) {
		t.Errorf("file exports %+v", f.file.fileExports)
	}
	w, _ := target.ParseExport("w=/w,ro")
	if got := mergeExports(f.file.fileExports, []target.ExportConfig{w, {Name: "v", Path: "/v2"}}); len(got) != 2 || got[0].Path != "/v2" || got[1].Name != "w" {
		t.Errorf("mergeExports: %+v", got)
	}
	// The file changes: cache_size stays the command line's, chunk_size
	// is a change (that needs a restart).
	c, err := config.Parse(path, []byte("cache_size: 2G\nchunk_size: 512K\ndrain_timeout: 3s\n"))
	if err != nil {
		t.Fatal(err)
	}
	now, err := fileSettings(c, f.file.cmdline)
	if err != nil {
		t.Fatal(err)
	}
	var changed []string
	for _, k := range sortedKeys(now) {
		if now[k] != f.file.running[k] {
			changed = append(changed, k)
		}
	}
	if !reflect.DeepEqual(changed, []string{"chunk_size"}) {
		t.Errorf("changed settings %v, want [chunk_size]", changed)
	}
}
