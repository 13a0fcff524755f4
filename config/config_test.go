package config_test

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/target"
)

// TestExampleFile: the documented example parses to what it says.
func TestExampleFile(t *testing.T) {
	c, err := config.Load("../systemd/rblkd.yaml.example")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"listen": "192.0.2.10:7480", "transport": "auto", "auth_file": "/etc/rblk/auth",
		"allow_unauthenticated": "false", "target_id": "storage-1", "cache_size": "4G", "chunk_size": "1M",
		"max_sessions": "1024", "max_sessions_per_host": "64", "max_unauthenticated": "128", "handshake_timeout": "10s",
		"max_handles_per_session": "16", "keepalive_timeout": "15s",
		"revoke_timeout": "10s", "drain_timeout": "10s", "drain_limit": "4m", "metrics_listen": "127.0.0.1:9480",
		"log_format": "json", "debug": "false", "admin_socket": "/run/rblk/rblkd.sock"}
	got := map[string]string{}
	for _, s := range c.Settings {
		got[s.Key] = s.Value
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("settings\n got %v\nwant %v", got, want)
	}
	if len(got) != len(config.Keys) {
		t.Errorf("the example sets %d settings, there are %d: document them all", len(got), len(config.Keys))
	}
	if s, _ := c.Setting("cache_size"); s.Line != 25 {
		t.Errorf("cache_size on line %d, want 25", s.Line)
	}
	wantExports := []target.ExportConfig{
		{Name: "vol0", Path: "/srv/rblk/vol0.img", Size: 100 << 30},
		{Name: "golden", Path: "/srv/rblk/golden.img", ReadOnly: true},
		{Name: "shared", Path: "/dev/disk/by-id/nvme-example", Shared: true, Allow: []string{"host-a", "host-b"}},
	}
	if !reflect.DeepEqual(c.ExportConfigs(), wantExports) {
		t.Errorf("exports\n got %+v\nwant %+v", c.ExportConfigs(), wantExports)
	}
}

// TestErrors: each kind of mistake names the file, its line and the field.
func TestErrors(t *testing.T) {
	for _, c := range []struct {
		name, in, want string
	}{
		{"syntax", "listen: a\n  bad: [\n", "rblkd.yaml:2: YAML: "},
		{"not a mapping", "- a\n- b\n", "rblkd.yaml:1: want a mapping"},
		{"empty", "", "rblkd.yaml: empty file"},
		{"unknown key", "listen: a\ncache: 1G\n", "rblkd.yaml:2: cache: unknown setting"},
		{"twice", "listen: a\nlisten: b\n", "rblkd.yaml:2: listen: given twice (first on line 1)"},
		{"bad size", "cache_size: lots\n", `rblkd.yaml:1: cache_size: size "lots"`},
		{"bad int", "max_sessions: -3\n", `rblkd.yaml:1: max_sessions: "-3": want a whole number`},
		{"bad duration", "\ndrain_timeout: 10\n", `rblkd.yaml:2: drain_timeout: "10": want a duration`},
		{"bad bool", "debug: yes please\n", `rblkd.yaml:1: debug: "yes please": want true or false`},
		{"bad choice", "transport: ib\n", `rblkd.yaml:1: transport: "ib": want one of tcp, rdma, auto`},
		{"list for scalar", "listen:\n  - a\n", "rblkd.yaml:2: listen: want a single value, not a list"},
		{"exports not a list", "exports: vol0\n", "rblkd.yaml:1: exports: want a list"},
		{"export not a mapping", "exports:\n  - vol0\n", "rblkd.yaml:2: exports[0]: want a mapping"},
		{"no name", "exports:\n  - path: /a\n", "rblkd.yaml:2: exports[0].name: missing"},
		{"no path", "exports:\n  - name: a\n", "rblkd.yaml:2: exports[0].path: missing"},
		{"bad export size", "exports:\n  - name: a\n    path: /a\n  - name: b\n    path: /b\n    size: 12Q\n",
			`rblkd.yaml:6: exports[1].size: size "12Q"`},
		{"zero size", "exports:\n  - name: a\n    path: /a\n    size: 0\n", `rblkd.yaml:4: exports[0].size: "0": want a size above 0`},
		{"unknown export key", "exports:\n  - name: a\n    path: /a\n    ro: true\n", "rblkd.yaml:4: exports[0].ro: unknown export option"},
		{"bad name", "exports:\n  - name: a/b\n    path: /a\n", `rblkd.yaml:2: exports[0].name: "a/b"`},
		{"export twice", "exports:\n  - name: a\n    path: /a\n  - name: a\n    path: /b\n", `rblkd.yaml:4: exports[1].name: export "a" given twice (first on line 2)`},
		{"allow not a list", "exports:\n  - name: a\n    path: /a\n    allow: host-a\n", "rblkd.yaml:4: exports[0].allow: want a list of host IDs"},
		{"bad read_only", "exports:\n  - name: a\n    path: /a\n    read_only: maybe\n", `rblkd.yaml:4: exports[0].read_only: "maybe"`},
		{"pools not a list", "pools: fast\n", "rblkd.yaml:1: pools: want a list"},
		{"pool no dir", "pools:\n  - name: fast\n", "rblkd.yaml:2: pools[0].directory: missing"},
		{"pool bad name", "pools:\n  - name: Fast:1\n    directory: /p\n", `rblkd.yaml:2: pools[0].name: "Fast:1": want 1-63 of a-z`},
		{"pool relative dir", "pools:\n  - name: a\n    directory: p\n", `rblkd.yaml:3: pools[0].directory: "p": want an absolute path`},
		{"pool root dir", "pools:\n  - name: a\n    directory: /\n", `rblkd.yaml:3: pools[0].directory: "/"`},
		{"pool twice", "pools:\n  - name: a\n    directory: /p\n  - name: a\n    directory: /q\n", `rblkd.yaml:4: pools[1].name: pool "a" given twice`},
		{"pool dir twice", "pools:\n  - name: a\n    directory: /p\n  - name: b\n    directory: /p/\n", `rblkd.yaml:4: pools[1].directory: /p is the directory of another pool`},
		{"pool zero capacity", "pools:\n  - name: a\n    directory: /p\n    capacity: 0\n", `rblkd.yaml:4: pools[0].capacity: "0": want a size above 0`},
		{"pool bad label", "pools:\n  - name: a\n    directory: /p\n    labels: {\"bad key!\": x}\n", `rblkd.yaml:4: pools[0].labels: line 4: "bad key!"`},
		{"management without pools", "management:\n  listen: :7481\n  cert: /c\n  key: /k\n  client_ca: /ca\n  clients: [{identity: x, pools: [\"*\"]}]\n",
			"rblkd.yaml:2: management: the management API manages pools"},
		{"management missing key", "pools:\n  - name: a\n    directory: /p\nmanagement:\n  listen: :7481\n  cert: /c\n  client_ca: /ca\n  clients: [{identity: x, pools: [a]}]\n",
			"rblkd.yaml:5: management.key: missing"},
		{"management unknown pool", "pools:\n  - name: a\n    directory: /p\nmanagement:\n  listen: :7481\n  cert: /c\n  key: /k\n  client_ca: /ca\n  clients: [{identity: x, pools: [b]}]\n",
			`rblkd.yaml:5: management.clients[0].pools: pool "b" is not one of pools:`},
		{"management client twice", "pools:\n  - name: a\n    directory: /p\nmanagement:\n  listen: :7481\n  cert: /c\n  key: /k\n  client_ca: /ca\n  clients: [{identity: x, pools: [a]}, {identity: x, pools: [a]}]\n",
			`rblkd.yaml:9: management.clients: line 9: client "x" given twice`},
		{"pool unknown key", "pools:\n  - name: a\n    directory: /p\n    size: 1G\n", "rblkd.yaml:4: pools[0].size: unknown pool option"},
	} {
		_, err := config.Parse("rblkd.yaml", []byte(c.in))
		if err == nil || !strings.HasPrefix(err.Error(), c.want) || !errors.Is(err, config.ErrInvalid) {
			t.Errorf("%s: %v\nwant an ErrInvalid starting with %q", c.name, err, c.want)
		}
	}
}

// TestPools: pools: parses into Pools.
func TestPools(t *testing.T) {
	c, err := config.Parse("rblkd.yaml", []byte(`pools:
  - name: fast
    directory: /srv/rblk/fast/
    capacity: 2T
    labels: {topology.rblk.io/zone: zone-a, topology.rblk.io/fabric: roce-1}
  - name: slow
    directory: /srv/rblk/slow
`))
	if err != nil {
		t.Fatal(err)
	}
	want := []config.Pool{
		{Name: "fast", Directory: "/srv/rblk/fast", Capacity: 2 << 40, Labels: map[string]string{"topology.rblk.io/zone": "zone-a", "topology.rblk.io/fabric": "roce-1"}, Line: 2},
		{Name: "slow", Directory: "/srv/rblk/slow", Line: 6},
	}
	if !reflect.DeepEqual(c.Pools, want) {
		t.Errorf("pools\n got %+v\nwant %+v", c.Pools, want)
	}
}

// TestExampleCommented: the example's commented pools: and management:
// parse once uncommented.
func TestExampleCommented(t *testing.T) {
	b, err := os.ReadFile("../systemd/rblkd.yaml.example")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	on := false
	for _, l := range strings.Split(string(b), "\n") {
		switch {
		case l == "#pools:" || l == "#management:":
			on = true
			l = l[1:]
		case on && strings.HasPrefix(l, "#  "):
			l = l[1:]
		default:
			on = false
		}
		out = append(out, l)
	}
	c, err := config.Parse("rblkd.yaml.example", []byte(strings.Join(out, "\n")))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Pools) != 1 || c.Management == nil || len(c.Management.Clients) != 1 {
		t.Fatalf("the example's pools %+v and management %+v, want one pool and one client", c.Pools, c.Management)
	}
}

// TestManagement: management: parses.
func TestManagement(t *testing.T) {
	c, err := config.Parse("rblkd.yaml", []byte(`pools:
  - name: fast
    directory: /srv/rblk/fast
management:
  listen: 192.0.2.10:7481
  cert: /etc/rblk/tls/server.crt
  key: /etc/rblk/tls/server.key
  client_ca: /etc/rblk/tls/ca.crt
  clients:
    - identity: rblk-csi-controller
      pools: ["*"]
    - identity: tenant
      pools: [fast]
`))
	if err != nil {
		t.Fatal(err)
	}
	want := &config.Management{Listen: "192.0.2.10:7481", Cert: "/etc/rblk/tls/server.crt", Key: "/etc/rblk/tls/server.key", ClientCA: "/etc/rblk/tls/ca.crt",
		Clients: []config.ManagementClient{{Identity: "rblk-csi-controller", Pools: []string{"*"}}, {Identity: "tenant", Pools: []string{"fast"}}}, Line: 5}
	if !reflect.DeepEqual(c.Management, want) {
		t.Errorf("management\n got %+v\nwant %+v", c.Management, want)
	}
}

// TestSave: changes keep the comments and the order, and the file read
// back holds them.
func TestSave(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rblkd.yaml")
	in := `# top comment
listen: 127.0.0.1:7480 # where
exports:
  # the first
  - name: a
    path: /srv/a.img
    size: 1G # grown later
  - name: b
    path: /srv/b.img
`
	if err := os.WriteFile(path, []byte(in), 0o640); err != nil {
		t.Fatal(err)
	}
	c, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	c.AddExport(target.ExportConfig{Name: "c", Path: "/srv/c.img", Size: 64 << 20, Shared: true, Allow: []string{"h1", "h2"}})
	if !c.RemoveExport("b") || c.RemoveExport("nope") {
		t.Fatal("RemoveExport")
	}
	if !c.SetExportSize("a", 2<<30) || c.SetExportSize("nope", 1) {
		t.Fatal("SetExportSize")
	}
	if err := c.Save(); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(path)
	want := `# top comment
listen: 127.0.0.1:7480 # where
exports:
  # the first
  - name: a
    path: /srv/a.img
    size: 2G # grown later
  - name: c
    path: /srv/c.img
    size: 64M
    shared: true
    allow: [h1, h2]
`
	if string(b) != want {
		t.Errorf("saved\n%s\nwant\n%s", b, want)
	}
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o640 {
		t.Errorf("mode %v after save, want 0640", st.Mode().Perm())
	}
	again, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(again.ExportConfigs(), c.ExportConfigs()) {
		t.Errorf("read back %+v, want %+v", again.ExportConfigs(), c.ExportConfigs())
	}
	// A file without exports gets them.
	c, err = config.Parse(path, []byte("listen: x\n"))
	if err != nil {
		t.Fatal(err)
	}
	c.AddExport(target.ExportConfig{Name: "v", Path: "/v", ReadOnly: true})
	b, _ = c.Marshal()
	if string(b) != "listen: x\nexports:\n  - name: v\n    path: /v\n    read_only: true\n" {
		t.Errorf("added to a file without exports:\n%s", b)
	}
	if entries, _ := os.ReadDir(filepath.Dir(path)); len(entries) != 1 {
		t.Errorf("save left files behind: %v", entries)
	}
}

func TestFormatSize(t *testing.T) {
	for n, want := range map[int64]string{4096: "4K", 1 << 30: "1G", 3 << 40: "3T", 1000: "1000", 1536 << 10: "1536K"} {
		if got := config.FormatSize(n); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestLoadNotAFile: a configuration path that is a FIFO, a socket or a
// directory is refused at once (a FIFO without a writer would block
// os.ReadFile for ever), naming the path and what it is.
func TestLoadNotAFile(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "rblkd.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "sock.yaml")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for path, kind := range map[string]string{fifo: "a FIFO", sock: "a socket", dir: "a directory"} {
		done := make(chan error, 1)
		go func() {
			_, err := config.Load(path)
			done <- err
		}()
		select {
		case err := <-done:
			if want := path + " is " + kind + ": want a regular file"; err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("Load of %s: %v, want an error saying %q", kind, err, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("Load of %s blocked", kind)
		}
	}
}

// TestStage: a staged save leaves the file as it was until Commit; Abort
// leaves no temporary file; a file reached through a symbolic link is
// written where the link points, and the link stays.
func TestStage(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "real.yaml")
	orig := "# kept\nexports:\n  - name: a\n    path: /a\n"
	if err := os.WriteFile(real, []byte(orig), 0o640); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "rblkd.yaml")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	c, err := config.Load(link)
	if err != nil {
		t.Fatal(err)
	}
	c.AddExport(target.ExportConfig{Name: "b", Path: "/b"})
	st, err := c.Stage()
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(real); string(b) != orig {
		t.Fatalf("staging changed the file:\n%s", b)
	}
	st.Abort()
	st.Abort()
	if entries, _ := os.ReadDir(dir); len(entries) != 2 {
		t.Fatalf("after Abort the folder holds %d entries, want the file and the link", len(entries))
	}
	if err := st.Commit(); err == nil {
		t.Error("Commit after Abort succeeded")
	}
	st, err = c.Stage()
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Commit(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Errorf("the link was replaced: %v, %v", fi, err)
	}
	b, _ := os.ReadFile(real)
	if !strings.Contains(string(b), "# kept") || !strings.Contains(string(b), "name: b") {
		t.Errorf("committed file:\n%s", b)
	}
	if fi, _ := os.Stat(real); fi.Mode().Perm() != 0o640 {
		t.Errorf("mode %v, want 0640 kept", fi.Mode().Perm())
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 2 {
		t.Errorf("after Commit the folder holds %d entries", len(entries))
	}
}
