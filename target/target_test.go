package target_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

func TestParseExport(t *testing.T) {
	for _, c := range []struct {
		in   string
		want target.ExportConfig
		err  bool
	}{
		{in: "vol0=/srv/a.img", want: target.ExportConfig{Name: "vol0", Path: "/srv/a.img"}},
		{in: "db=/dev/sdb,ro", want: target.ExportConfig{Name: "db", Path: "/dev/sdb", ReadOnly: true}},
		{in: "v=/x,size=10G", want: target.ExportConfig{Name: "v", Path: "/x", Size: 10 << 30}},
		{in: "v=/x,size=4096,ro", want: target.ExportConfig{Name: "v", Path: "/x", Size: 4096, ReadOnly: true}},
		{in: "novalue", err: true},
		{in: "=/x", err: true},
		{in: "v=", err: true},
		{in: "v=/x,size=abc", err: true},
		{in: "v=/x,size=0", err: true},
		{in: "v=/x,bogus", err: true},
		{in: "a/b=/x", err: true},
		{in: "v=/x,shared", want: target.ExportConfig{Name: "v", Path: "/x", Shared: true}},
		{in: "v=/x,allow=host-a:host-b", want: target.ExportConfig{Name: "v", Path: "/x", Allow: []string{"host-a", "host-b"}}},
		{in: "v=/x,allow=", err: true},
		{in: "v=/x,allow=a::b", err: true},
	} {
		got, err := target.ParseExport(c.in)
		if (err != nil) != c.err || (err == nil && !reflect.DeepEqual(got, c.want)) {
			t.Errorf("ParseExport(%q) = %+v, %v", c.in, got, err)
		}
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"4096": 4096, "64K": 64 << 10, "256M": 256 << 20, "1g": 1 << 30, "2GiB": 2 << 30, "1T": 1 << 40, "10MB": 10 << 20} {
		if got, err := target.ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1", "1X", "99999999999T"} {
		if _, err := target.ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) succeeded", in)
		}
	}
}

func TestNewErrors(t *testing.T) {
	dir := t.TempDir()
	for name, o := range map[string]target.Options{
		"missing file":     {Exports: []target.ExportConfig{{Name: "v", Path: filepath.Join(dir, "nope")}}},
		"duplicate":        {Exports: []target.ExportConfig{{Name: "v", Path: filepath.Join(dir, "a"), Size: 1 << 20}, {Name: "v", Path: filepath.Join(dir, "b"), Size: 1 << 20}}},
		"bad chunk size":   {Exports: []target.ExportConfig{{Name: "v", Path: filepath.Join(dir, "c"), Size: 1 << 20}}, ChunkSize: 100000},
		"cache too small":  {Exports: []target.ExportConfig{{Name: "v", Path: filepath.Join(dir, "d"), Size: 1 << 20}}, CacheSize: 1 << 20},
		"not a file":       {Exports: []target.ExportConfig{{Name: "v", Path: "/dev/null"}}},
		"empty, no size=":  {Exports: []target.ExportConfig{{Name: "v", Path: emptyFile(t)}}},
		"ro and not there": {Exports: []target.ExportConfig{{Name: "v", Path: filepath.Join(dir, "e"), Size: 1 << 20, ReadOnly: true}}},
	} {
		if tg, err := target.New(o); err == nil {
			tg.Close()
			t.Errorf("%s: New succeeded", name)
		}
	}
}

// TestNewWithoutExports: a target may start with no export and get its
// first at run time.
func TestNewWithoutExports(t *testing.T) {
	tg, err := target.New(target.Options{CacheSize: 4 << 20, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	if err := tg.AddExport(context.Background(), target.ExportConfig{Name: "late", Path: filepath.Join(t.TempDir(), "late.img"), Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	if st := tg.Exports(); len(st) != 1 || st[0].Config.Name != "late" {
		t.Fatalf("exports: %+v", st)
	}
}

func emptyFile(t *testing.T) string {
	p := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

type env struct {
	t    *testing.T
	tg   *target.Target
	p    transport.Provider
	addr string
	path string
}

// start serves content as the export "vol", shared (the tests of the
// cache let several initiators write).
func start(t *testing.T, ro bool, content []byte) *env {
	t.Helper()
	e, _ := startWith(t, content, target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, DrainTimeout: time.Second},
		target.ExportConfig{ReadOnly: ro, Shared: !ro})
	return e
}

// startWith serves content as the export "vol" (export's other fields as
// given) with opts, whose metrics go to the returned registry.
func startWith(t *testing.T, content []byte, opts target.Options, export target.ExportConfig) (*env, *prometheus.Registry) {
	t.Helper()
	transporttest.CheckGoroutines(t)
	path := filepath.Join(t.TempDir(), "vol.img")
	if err := os.WriteFile(path, content, 0o600); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	export.Name, export.Path = "vol", path
	opts.Exports = []target.ExportConfig{export}
	opts.Registerer = reg
	tg, err := target.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	p, laddr := testProvider(t)
	ctx, cancel := context.WithCancel(context.Background())
	l, err := p.Listen(ctx, laddr)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { tg.Serve(ctx, l); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
		if err := tg.Close(); err != nil {
			t.Error(err)
		}
	})
	return &env{t: t, tg: tg, p: p, addr: l.Addr(), path: path}, reg
}

// client is a raw protocol client: it speaks messages and RDMA itself.
type client struct {
	*link.Link
	info protocol.VolumeInfo
	// revoked gets the offset of each revoke dialAs's client acknowledged
	// (while it has room).
	revoked chan uint64
}

func (e *env) dial(mode protocol.Mode) (*client, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	l, err := link.Dial(ctx, e.p, e.addr, link.Options{Handler: func(h protocol.Header, p []byte) {}})
	if err != nil {
		return nil, err
	}
	e.t.Cleanup(func() { l.Close() })
	c := &client{Link: l}
	if _, err := auth.Initiate(ctx, l, "", nil); err != nil {
		return nil, err
	}
	return c, l.Request(ctx, &protocol.Open{Mode: mode, Name: "vol"}, &c.info)
}

func TestGrantReadWrite(t *testing.T) {
	content := bytes.Repeat([]byte{7}, 256<<10)
	e := start(t, false, content)
	c, err := e.dial(protocol.ModeReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var g protocol.Grant
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: 70000}, &g); err != nil {
		t.Fatal(err)
	}
	if g.Offset != 64<<10 || g.Length != 64<<10 || g.Flags&protocol.GrantWrite == 0 {
		t.Fatalf("grant %+v", g)
	}
	mem, _ := transport.AllocMemory(64<<10, false)
	defer mem.Free()
	local, err := c.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	// Read the chunk: the file's bytes.
	if err := c.RDMA(ctx, link.Op{Local: transport.SGE{Region: local, Length: 64 << 10}, Addr: g.Addr, RKey: g.RKey}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(local.Bytes(), content[64<<10:128<<10]) {
		t.Fatal("chunk does not hold the file's bytes")
	}
	// Write 5 bytes at volume offset 70000, report them, flush: the file has them.
	copy(local.Bytes(), "rblk!")
	if err := c.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: 5}, Addr: g.Addr + 70000 - g.Offset, RKey: g.RKey}); err != nil {
		t.Fatal(err)
	}
	if err := c.Send(ctx, 0, &protocol.Done{Handle: c.info.Handle, Generation: c.info.Generation, Ranges: []protocol.Range{{Offset: 70000, Length: 5}}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Request(ctx, &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	file, _ := os.ReadFile(e.path)
	want := bytes.Clone(content)
	copy(want[70000:], "rblk!")
	if !bytes.Equal(file, want) {
		t.Fatal("after Done and Flush the file does not hold exactly the write")
	}
	// Write-zeroes reaches the cached copy too.
	if err := c.Request(ctx, &protocol.WriteZeroes{Handle: c.info.Handle, Offset: 69990, Length: 20}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	if err := c.RDMA(ctx, link.Op{Local: transport.SGE{Region: local, Length: 64 << 10}, Addr: g.Addr, RKey: g.RKey}); err != nil {
		t.Fatal(err)
	}
	clear(want[69990:70010])
	if !bytes.Equal(local.Bytes(), want[64<<10:128<<10]) {
		t.Fatal("cached chunk not zeroed")
	}
	if file, _ := os.ReadFile(e.path); !bytes.Equal(file, want) {
		t.Fatal("file not zeroed")
	}
	// Out of range: an error, and the session goes on.
	err = c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Offset: 1 << 30}, &g)
	if !errors.Is(err, protocol.ErrRange) {
		t.Fatalf("grant beyond the end: %v, want ErrRange", err)
	}
	if err := c.Request(ctx, &protocol.Trim{Handle: c.info.Handle, Offset: 256<<10 - 1, Length: 2}, &protocol.OK{}); !errors.Is(err, protocol.ErrRange) {
		t.Fatalf("trim across the end: %v, want ErrRange", err)
	}
	if err := c.Request(ctx, &protocol.Flush{Handle: 99, Generation: 1}, &protocol.OK{}); !errors.Is(err, protocol.ErrInvalid) {
		t.Fatalf("flush of an unknown handle: %v, want ErrInvalid", err)
	}
	if err := c.Request(ctx, &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	local.Deregister()
}

// TestReadOnlyExport: a read-write open is refused, and a read-only grant
// is registered without remote write, so an RDMA WRITE into it fails.
func TestReadOnlyExport(t *testing.T) {
	content := bytes.Repeat([]byte{9}, 128<<10)
	e := start(t, true, content)
	if _, err := e.dial(protocol.ModeReadWrite); !errors.Is(err, protocol.ErrPerm) {
		t.Fatalf("read-write open of a read-only export: %v, want ErrPerm", err)
	}
	c, err := e.dial(protocol.ModeReadOnly)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var g protocol.Grant
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite}, &g); !errors.Is(err, protocol.ErrPerm) {
		t.Fatalf("write grant on a read-only open: %v, want ErrPerm", err)
	}
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle}, &g); err != nil {
		t.Fatal(err)
	}
	if g.Flags&protocol.GrantWrite != 0 {
		t.Fatal("read-only grant is writable")
	}
	mem, _ := transport.AllocMemory(4096, false)
	defer mem.Free()
	local, _ := c.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	err = c.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: 10}, Addr: g.Addr, RKey: g.RKey})
	if !transporttest.Refused(err) {
		t.Fatalf("RDMA WRITE into a read-only grant: %v, want a remote access error", err)
	}
	if file, _ := os.ReadFile(e.path); !bytes.Equal(file, content) {
		t.Fatal("read-only backing file changed")
	}
}

// TestBrokenInitiatorLosesOnlyItsSession: a Done for a chunk the session
// holds no grant of, and garbage, close that session; others go on.
func TestBrokenInitiatorLosesOnlyItsSession(t *testing.T) {
	e := start(t, false, make([]byte, 256<<10))
	good, err := e.dial(protocol.ModeReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	bad, err := e.dial(protocol.ModeReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := bad.Send(ctx, 0, &protocol.Done{Handle: bad.info.Handle, Generation: bad.info.Generation, Ranges: []protocol.Range{{Offset: 0, Length: 10}}}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-bad.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("target kept a session that reported writes outside its grants")
	}
	var g protocol.Grant
	if err := good.Request(ctx, &protocol.GrantRequest{Handle: good.info.Handle}, &g); err != nil {
		t.Fatalf("other session: %v", err)
	}
}

// TestEvictionRevokes: with more chunks in use than the cache holds, the
// target revokes grants (the initiator must acknowledge), writes dirty
// chunks back, and the data stays right.
func TestEvictionRevokes(t *testing.T) {
	e := start(t, false, make([]byte, 2<<20)) // 32 chunks, cache of 16
	revokes := make(chan protocol.Revoke, 64)
	var l *link.Link
	ready := make(chan struct{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := link.Dial(ctx, e.p, e.addr, link.Options{Handler: func(h protocol.Header, p []byte) {
		<-ready
		var r protocol.Revoke
		if h.Type != protocol.TypeRevoke || r.Unmarshal(p) != nil {
			t.Errorf("unexpected %v", h.Type)
			return
		}
		revokes <- r
		go l.Send(context.Background(), h.Tag, &protocol.RevokeAck{Handle: r.Handle, Offset: r.Offset, Generation: r.Generation})
	}})
	if err != nil {
		t.Fatal(err)
	}
	close(ready)
	defer l.Close()
	if _, err := auth.Initiate(ctx, l, "", nil); err != nil {
		t.Fatal(err)
	}
	var info protocol.VolumeInfo
	if err := l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol"}, &info); err != nil {
		t.Fatal(err)
	}
	mem, _ := transport.AllocMemory(4096, false)
	defer mem.Free()
	local, _ := l.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	for i := range 32 {
		var g protocol.Grant
		if err := l.Request(ctx, &protocol.GrantRequest{Handle: info.Handle, Flags: protocol.GrantWrite, Offset: uint64(i) << 16}, &g); err != nil {
			t.Fatal(err)
		}
		local.Bytes()[0] = byte(i + 1)
		if err := l.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: 1}, Addr: g.Addr, RKey: g.RKey}); err != nil {
			t.Fatal(err)
		}
		if err := l.Send(ctx, 0, &protocol.Done{Handle: info.Handle, Generation: info.Generation, Ranges: []protocol.Range{{Offset: uint64(i) << 16, Length: 1}}}); err != nil {
			t.Fatal(err)
		}
	}
	if len(revokes) < 16 {
		t.Fatalf("%d revokes for 32 chunks in a cache of 16", len(revokes))
	}
	if err := l.Request(ctx, &protocol.Flush{Handle: info.Handle, Generation: info.Generation}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	file, _ := os.ReadFile(e.path)
	for i := range 32 {
		if file[i<<16] != byte(i+1) {
			t.Fatalf("chunk %d: byte %d, want %d", i, file[i<<16], i+1)
		}
	}
	local.Deregister()
}
