package manage_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/manage"
	"github.com/rblk/rblk/pool"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
)

// node is a target with pools, served over TCP on loopback, and its
// Service.
type node struct {
	t    *testing.T
	tg   *target.Target
	svc  *manage.Service
	p    transport.Provider
	addr string
	dir  string
	stop func()
}

// startNode serves the pools "fast" (8 MiB) and "slow" under dir.
func startNode(t *testing.T, dir string) *node {
	t.Helper()
	tg, err := target.New(target.Options{CacheSize: 4 << 20, ChunkSize: 64 << 10, DrainTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var pools []*pool.Pool
	for _, c := range []pool.Config{
		{Name: "fast", Dir: filepath.Join(dir, "fast"), Capacity: 8 << 20, Labels: map[string]string{"topology.rblk.io/zone": "a"}},
		{Name: "slow", Dir: filepath.Join(dir, "slow")},
	} {
		p, err := pool.Open(c)
		if err != nil {
			t.Fatal(err)
		}
		pools = append(pools, p)
	}
	ctx, cancel := context.WithCancel(context.Background())
	svc, err := manage.New(ctx, tg, pools, manage.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := tcp.New("tcp")
	l, err := p.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { tg.Serve(ctx, l); close(done) }()
	n := &node{t: t, tg: tg, svc: svc, p: p, addr: l.Addr(), dir: dir}
	var stopped bool
	n.stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		<-done
		if err := tg.Close(); err != nil {
			t.Error(err)
		}
		for _, p := range pools {
			p.Close()
		}
	}
	t.Cleanup(n.stop)
	return n
}

// open connects as host and opens export.
func (n *node) open(host, export string, mode protocol.Mode) (*link.Link, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := link.Dial(ctx, n.p, n.addr, link.Options{Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		return nil, err
	}
	n.t.Cleanup(func() { l.Close() })
	if _, err := auth.Initiate(ctx, l, host, nil); err != nil {
		return l, err
	}
	var info protocol.VolumeInfo
	return l, l.Request(ctx, &protocol.Open{Mode: mode, Name: export, HostID: host}, &info)
}

func TestLifecycle(t *testing.T) {
	transporttest.CheckGoroutines(t)
	dir := t.TempDir()
	n := startNode(t, dir)
	ctx := context.Background()
	v, created, err := n.svc.Create(ctx, "fast", "pvc-1", 4<<20, false)
	if err != nil || !created {
		t.Fatalf("create: %v, created %v", err, created)
	}
	if v.Export != "fast:pvc-1" || v.Size != 4<<20 || v.Labels["topology.rblk.io/zone"] != "a" {
		t.Fatalf("created %+v", v)
	}
	// Served, and published to nobody.
	if _, err := n.open("node-a", v.Export, protocol.ModeReadWrite); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("open before publish: %v, want ErrAccess", err)
	}
	if _, err := n.svc.Publish(ctx, "fast", "pvc-1", "node-a"); err != nil {
		t.Fatal(err)
	}
	a, err := n.open("node-a", v.Export, protocol.ModeReadWrite)
	if err != nil {
		t.Fatalf("open after publish: %v", err)
	}
	if _, err := n.open("node-b", v.Export, protocol.ModeReadOnly); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("open by a host not published to: %v, want ErrAccess", err)
	}
	// Expand online.
	if v, err = n.svc.Expand(ctx, "fast", "pvc-1", 6<<20); err != nil || v.Size != 6<<20 {
		t.Fatalf("expand: %+v, %v", v, err)
	}
	if _, err := n.svc.Expand(ctx, "fast", "pvc-1", 16<<20); manage.CodeOf(err) != manage.ResourceExhausted {
		t.Fatalf("expand past the pool's capacity: %v (%s), want ResourceExhausted", err, manage.CodeOf(err))
	}
	// Unpublish fences node-a before it returns.
	fenced, err := n.svc.Unpublish(ctx, "fast", "pvc-1", "node-a")
	if err != nil || fenced != 1 {
		t.Fatalf("unpublish: %d fenced, %v; want 1", fenced, err)
	}
	select {
	case <-a.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("node-a's session outlived its unpublish")
	}
	if _, err := n.open("node-a", v.Export, protocol.ModeReadWrite); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("open after unpublish: %v, want ErrAccess", err)
	}
	if _, err := n.svc.Publish(ctx, "fast", "pvc-1", "node-b"); err != nil {
		t.Fatal(err)
	}
	// A restart serves what was recorded: node-b, 6 MiB.
	n.stop()
	n = startNode(t, dir)
	got, err := n.svc.Get("fast", "pvc-1")
	if err != nil || got.Size != 6<<20 || len(got.Hosts) != 1 || got.Hosts[0] != "node-b" {
		t.Fatalf("after restart: %+v, %v", got, err)
	}
	if _, err := n.open("node-b", v.Export, protocol.ModeReadWrite); err != nil {
		t.Fatalf("open by node-b after restart: %v", err)
	}
	if _, err := n.open("node-a", v.Export, protocol.ModeReadWrite); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("open by node-a after restart: %v, want ErrAccess", err)
	}
	// Delete drains node-b and removes the files.
	if err := n.svc.Delete(ctx, "fast", "pvc-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(v.Path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("data file after delete: %v", err)
	}
	for _, st := range n.tg.Exports() {
		t.Fatalf("export %q served after delete", st.Config.Name)
	}
	if err := n.svc.Delete(ctx, "fast", "pvc-1"); manage.CodeOf(err) != manage.NotFound {
		t.Fatalf("delete again: %v, want NotFound", err)
	}
}

// TestCodes: each kind of bad request gets its code, and changes nothing.
func TestCodes(t *testing.T) {
	transporttest.CheckGoroutines(t)
	n := startNode(t, t.TempDir())
	ctx := context.Background()
	if _, _, err := n.svc.Create(ctx, "fast", "a", 4<<20, false); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		what string
		err  error
		want manage.Code
	}{
		{"create with '/'", second(n.svc.Create(ctx, "fast", "a/b", 4096, false)), manage.InvalidArgument},
		{"create with ..", second(n.svc.Create(ctx, "fast", "..", 4096, false)), manage.InvalidArgument},
		{"create of a bad size", second(n.svc.Create(ctx, "fast", "b", 1000, false)), manage.InvalidArgument},
		{"create in no pool", second(n.svc.Create(ctx, "nope", "b", 4096, false)), manage.NotFound},
		{"create with another size", second(n.svc.Create(ctx, "fast", "a", 8<<20, false)), manage.AlreadyExists},
		{"create past capacity", second(n.svc.Create(ctx, "fast", "b", 8<<20, false)), manage.ResourceExhausted},
		{"publish an empty host", first(n.svc.Publish(ctx, "fast", "a", "")), manage.InvalidArgument},
		{"publish an unknown volume", first(n.svc.Publish(ctx, "fast", "b", "h")), manage.NotFound},
		{"unpublish an unknown volume", first(n.svc.Unpublish(ctx, "fast", "b", "h")), manage.NotFound},
		{"shrink", first(n.svc.Expand(ctx, "fast", "a", 4096)), manage.InvalidArgument},
		{"delete in no pool", n.svc.Delete(ctx, "nope", "a"), manage.NotFound},
	} {
		if got := manage.CodeOf(c.err); got != c.want {
			t.Errorf("%s: %v (%s), want %s", c.what, c.err, got, c.want)
		}
	}
	if vols, err := n.svc.List(""); err != nil || len(vols) != 1 {
		t.Fatalf("volumes after the refused requests: %+v, %v; want one", vols, err)
	}
	ps, err := n.svc.Pools("")
	if err != nil || len(ps) != 2 || ps[0].Name != "fast" || ps[0].Provisioned != 4<<20 || ps[0].Available != 4<<20 {
		t.Fatalf("pools: %+v, %v", ps, err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(n.svc.Collector())
	for name, want := range map[string]float64{"rblkd_pool_capacity_bytes": 8 << 20, "rblkd_pool_provisioned_bytes": 4 << 20,
		"rblkd_pool_available_bytes": 4 << 20, "rblkd_pool_volumes": 1, "rblkd_pool_volumes_damaged": 0} {
		if got := metricstest.Value(t, reg, name, "pool", "fast"); got != want {
			t.Errorf("%s{pool=\"fast\"} = %v, want %v", name, got, want)
		}
	}
}

func first[T any](_ T, err error) error          { return err }
func second[T, U any](_ T, _ U, err error) error { return err }

// TestPublishUnknownHost: with KnownHost, a host rblkd has no key for is
// NotFound, and nothing is recorded.
func TestPublishUnknownHost(t *testing.T) {
	transporttest.CheckGoroutines(t)
	tg, err := target.New(target.Options{CacheSize: 4 << 20, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	p, err := pool.Open(pool.Config{Name: "fast", Dir: filepath.Join(t.TempDir(), "fast")})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx := context.Background()
	svc, err := manage.New(ctx, tg, []*pool.Pool{p}, manage.Options{KnownHost: func(h string) bool { return h == "node-a" }})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := svc.Create(ctx, "fast", "v", 4096, false); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Publish(ctx, "fast", "v", "node-x"); !errors.Is(err, manage.ErrUnknownHost) || manage.CodeOf(err) != manage.NotFound {
		t.Fatalf("publish to a host without a key: %v (%s), want ErrUnknownHost, NotFound", err, manage.CodeOf(err))
	}
	if _, err := svc.Publish(ctx, "fast", "v", "node-a"); err != nil {
		t.Fatal(err)
	}
	if v, _ := svc.Get("fast", "v"); len(v.Hosts) != 1 || v.Hosts[0] != "node-a" {
		t.Fatalf("hosts %q, want [node-a]", v.Hosts)
	}
}

// failingTarget is a target whose PrepareExport fails for one export.
type failingTarget struct {
	*target.Target
	fail string
}

func (f *failingTarget) PrepareExport(ctx context.Context, e target.ExportConfig) (*target.PreparedExport, error) {
	if e.Name == f.fail {
		return nil, errors.New("injected: cannot open")
	}
	return f.Target.PrepareExport(ctx, e)
}

// TestOneVolumeNotServed: a volume the target cannot open at start keeps
// neither the Service nor the other volumes down, and a create of it
// serves it once the target can.
func TestOneVolumeNotServed(t *testing.T) {
	transporttest.CheckGoroutines(t)
	dir := filepath.Join(t.TempDir(), "fast")
	ctx := context.Background()
	p, err := pool.Open(pool.Config{Name: "fast", Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"good", "bad"} {
		if _, _, err := p.Create(n, 1<<20, false); err != nil {
			t.Fatal(err)
		}
	}
	tg, err := target.New(target.Options{CacheSize: 4 << 20, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	ft := &failingTarget{Target: tg, fail: "fast:bad"}
	svc, err := manage.New(ctx, ft, []*pool.Pool{p}, manage.Options{})
	if err != nil {
		t.Fatalf("New with a volume the target cannot open: %v", err)
	}
	defer p.Close()
	served := func() []string {
		var out []string
		for _, st := range tg.Exports() {
			out = append(out, st.Config.Name)
		}
		return out
	}
	if got := served(); len(got) != 1 || got[0] != "fast:good" {
		t.Fatalf("served: %q, want fast:good alone", got)
	}
	ft.fail = ""
	if _, created, err := svc.Create(ctx, "fast", "bad", 1<<20, false); err != nil || created {
		t.Fatalf("create of the volume not served: created %v, %v", created, err)
	}
	if got := served(); len(got) != 2 {
		t.Fatalf("served after the create: %q, want both", got)
	}
}
