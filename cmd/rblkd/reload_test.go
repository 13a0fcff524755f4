package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/transporttest"
)

// TestReloadDiff: a reload adds, removes, updates and replaces exports as
// the file says, leaves unchanged ones alone, keeps settings that need a
// restart, and refuses a shrink or an invalid file without changing
// anything.
func TestReloadDiff(t *testing.T) {
	transporttest.CheckGoroutines(t)
	dir := t.TempDir()
	img := func(n string) string { return filepath.Join(dir, n+".img") }
	cfg := filepath.Join(dir, "rblkd.yaml")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(cfg, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("cache_size: 4M\nexports:\n" +
		"  - {name: keep, path: " + img("keep") + ", size: 1M}\n" +
		"  - {name: gone, path: " + img("gone") + ", size: 1M}\n" +
		"  - {name: upd, path: " + img("upd") + ", size: 1M}\n" +
		"  - {name: repl, path: " + img("repl") + ", size: 1M}\n")
	cmd := newServeCmd()
	if err := cmd.ParseFlags([]string{"--config", cfg, "--chunk-size", "64K"}); err != nil {
		t.Fatal(err)
	}
	f := serveFlags{config: cfg}
	if err := loadConfig(cmd, &f); err != nil {
		t.Fatal(err)
	}
	tg, err := target.New(target.Options{Exports: f.file.fileExports, CacheSize: 4 << 20, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	core, logs := observer.New(zap.InfoLevel)
	ctx := context.Background()
	d, err := startDaemon(ctx, tg, nil, f, nil, nil, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	defer d.stop()
	state := func() map[string]target.ExportConfig {
		m := map[string]target.ExportConfig{}
		for _, st := range tg.Exports() {
			m[st.Config.Name] = st.Config
		}
		return m
	}

	// repl moves to another existing file (a reload never creates one
	// for an export it serves: a mistyped path is refused).
	if err := os.WriteFile(img("repl2"), make([]byte, 2<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	write("cache_size: 8M\nchunk_size: 1M\nexports:\n" +
		"  - {name: keep, path: " + img("keep") + ", size: 1M}\n" +
		"  - {name: upd, path: " + img("upd") + ", size: 1M, shared: true, allow: [h1]}\n" +
		"  - {name: repl, path: " + img("repl2") + ", size: 2M}\n" +
		"  - {name: new, path: " + img("new") + ", size: 1M, read_only: false}\n")
	msg, err := reloadLocked(ctx, d)
	if err != nil {
		t.Fatal(err)
	}
	if want := "cache_size needs a restart, added new, removed gone, replaced repl, updated upd"; msg != want {
		t.Errorf("reload: %q, want %q", msg, want)
	}
	s := state()
	if len(s) != 4 || !s["upd"].Shared || len(s["upd"].Allow) != 1 || s["repl"].Path != img("repl2") || s["new"].Path != img("new") {
		t.Errorf("exports after the reload: %+v", s)
	}
	if n := logs.FilterMessage("setting changed in the configuration needs a restart: keeping the running value").Len(); n != 1 {
		t.Errorf("%d needs-a-restart warnings, want 1 (cache_size; chunk_size is the command line's)", n)
	}

	// A shrink: refused, nothing changes (not even the new export).
	write("exports:\n  - {name: keep, path: " + img("keep") + ", size: 4K}\n  - {name: other, path: " + img("other") + ", size: 1M}\n")
	_, err = reloadLocked(ctx, d)
	if !errors.Is(err, target.ErrShrink) || !strings.Contains(err.Error(), cfg+":2: export \"keep\"") {
		t.Errorf("reload with a shrink: %v, want ErrShrink naming the file and line", err)
	}
	// An invalid file: refused with its line.
	write("exports:\n  - {name: keep, path: " + img("keep") + ", size: 1M, colour: red}\n")
	_, err = reloadLocked(ctx, d)
	if !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), cfg+":2: exports[0].colour") {
		t.Errorf("reload of an invalid file: %v", err)
	}
	if s2 := state(); len(s2) != 4 || s2["other"].Name != "" {
		t.Errorf("a refused reload changed the exports: %+v", s2)
	}
}
