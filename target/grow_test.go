package target_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

// notice is a message the target sent on its own: a Revoke (acknowledged
// at once) or a Resize.
type notice struct {
	typ  protocol.Type
	off  uint64 // Revoke: the chunk
	size uint64 // Resize: the new size
	h    uint32
}

// dialNotices opens "vol" on a connection that acknowledges revokes and
// records every Revoke and Resize, in order, on the returned channel.
func (e *env) dialNotices(ctx context.Context, mode protocol.Mode) (*client, <-chan notice) {
	e.t.Helper()
	ch := make(chan notice, 64)
	ready := make(chan struct{})
	var l *link.Link
	l, err := link.Dial(ctx, e.p, e.addr, link.Options{Handler: func(h protocol.Header, p []byte) {
		<-ready
		switch h.Type {
		case protocol.TypeRevoke:
			var r protocol.Revoke
			if err := r.Unmarshal(p); err != nil {
				e.t.Errorf("revoke: %v", err)
				return
			}
			ch <- notice{typ: h.Type, off: r.Offset, h: r.Handle}
			go l.Send(context.Background(), h.Tag, &protocol.RevokeAck{Handle: r.Handle, Offset: r.Offset, Generation: r.Generation})
		case protocol.TypeResize:
			var r protocol.Resize
			if err := r.Unmarshal(p); err != nil {
				e.t.Errorf("resize: %v", err)
				return
			}
			if h.Tag != 0 {
				e.t.Errorf("Resize with tag %d, want a notice (tag 0)", h.Tag)
			}
			ch <- notice{typ: h.Type, size: r.VolumeSize, h: r.Handle}
		default:
			e.t.Errorf("unexpected %v from the target", h.Type)
		}
	}})
	if err != nil {
		e.t.Fatal(err)
	}
	close(ready)
	e.t.Cleanup(func() { l.Close() })
	if _, err := auth.Initiate(ctx, l, "", nil); err != nil {
		e.t.Fatal(err)
	}
	c := &client{Link: l}
	if err := l.Request(ctx, &protocol.Open{Mode: mode, Name: "vol"}, &c.info); err != nil {
		e.t.Fatal(err)
	}
	return c, ch
}

func next(t *testing.T, ch <-chan notice) notice {
	t.Helper()
	select {
	case n := <-ch:
		return n
	case <-time.After(10 * time.Second):
		t.Fatal("no notice from the target")
		return notice{}
	}
}

// TestGrow: a volume of 96 KiB (its last 64 KiB chunk short) grows to
// 256 KiB under a session that holds a write grant of that short chunk:
// the grant is revoked before the Resize notice, IO beyond the old end is
// refused before and served after (the written chunk kept), the file has
// the new size, new opens and the export list report it, and the metric
// counts it.
func TestGrow(t *testing.T) {
	const oldSize, newSize = 96 << 10, 256 << 10
	content := bytes.Repeat([]byte{5}, oldSize)
	e, reg := startWith(t, content, target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, DrainTimeout: time.Second},
		target.ExportConfig{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, notices := e.dialNotices(ctx, protocol.ModeReadWrite)
	if c.info.VolumeSize != oldSize {
		t.Fatalf("VolumeInfo size %d, want %d", c.info.VolumeSize, oldSize)
	}
	mem, _ := transport.AllocMemory(64<<10, false)
	defer mem.Free()
	local, err := c.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Deregister()

	// The short last chunk, written.
	var g protocol.Grant
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: 70000}, &g); err != nil {
		t.Fatal(err)
	}
	if g.Offset != 64<<10 || g.Length != 32<<10 {
		t.Fatalf("grant of the last chunk: %+v, want 32 KiB at 64 KiB", g)
	}
	copy(local.Bytes(), "grow")
	if err := c.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: 4}, Addr: g.Addr + 70000 - g.Offset, RKey: g.RKey}); err != nil {
		t.Fatal(err)
	}
	if err := c.Send(ctx, 0, &protocol.Done{Handle: c.info.Handle, Generation: c.info.Generation, Ranges: []protocol.Range{{Offset: 70000, Length: 4}}}); err != nil {
		t.Fatal(err)
	}
	// Beyond the end: refused.
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: 200000}, &g); !errors.Is(err, protocol.ErrRange) {
		t.Fatalf("grant beyond the end before the grow: %v, want ErrRange", err)
	}
	if err := c.Request(ctx, &protocol.Trim{Handle: c.info.Handle, Offset: oldSize, Length: 4096}, &protocol.OK{}); !errors.Is(err, protocol.ErrRange) {
		t.Fatalf("trim beyond the end before the grow: %v, want ErrRange", err)
	}

	if err := e.tg.Grow(ctx, "vol", newSize); err != nil {
		t.Fatal(err)
	}
	// The short chunk's grant is revoked, then the notice comes.
	if n := next(t, notices); n.typ != protocol.TypeRevoke || n.off != 64<<10 {
		t.Fatalf("first notice %+v, want the revoke of the chunk at 64 KiB", n)
	}
	if n := next(t, notices); n.typ != protocol.TypeResize || n.size != newSize || n.h != c.info.Handle {
		t.Fatalf("second notice %+v, want Resize of handle %d to %d", n, c.info.Handle, newSize)
	}
	if st, err := os.Stat(e.path); err != nil || st.Size() != newSize {
		t.Fatalf("backing file after the grow: %v, %v; want %d bytes", st, err, newSize)
	}

	// The old last chunk, whole now, kept what was written; its new part
	// reads as zeroes.
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: 70000}, &g); err != nil {
		t.Fatal(err)
	}
	if g.Offset != 64<<10 || g.Length != 64<<10 {
		t.Fatalf("grant of the old last chunk after the grow: %+v, want 64 KiB at 64 KiB", g)
	}
	if err := c.RDMA(ctx, link.Op{Local: transport.SGE{Region: local, Length: 64 << 10}, Addr: g.Addr, RKey: g.RKey}); err != nil {
		t.Fatal(err)
	}
	want := append(bytes.Repeat([]byte{5}, 32<<10), make([]byte, 32<<10)...)
	copy(want[70000-65536:], "grow")
	if !bytes.Equal(local.Bytes(), want) {
		t.Fatal("the old last chunk, loaded again, does not hold the write and zeroes past the old end")
	}
	// Beyond the old end: served.
	if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: 200000}, &g); err != nil {
		t.Fatalf("grant beyond the old end after the grow: %v", err)
	}
	copy(local.Bytes(), "tail")
	if err := c.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: 4}, Addr: g.Addr + newSize - 4 - g.Offset, RKey: g.RKey}); err != nil {
		t.Fatal(err)
	}
	if err := c.Send(ctx, 0, &protocol.Done{Handle: c.info.Handle, Generation: c.info.Generation, Ranges: []protocol.Range{{Offset: newSize - 4, Length: 4}}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Request(ctx, &protocol.Trim{Handle: c.info.Handle, Offset: oldSize, Length: 4096}, &protocol.OK{}); err != nil {
		t.Fatalf("trim beyond the old end after the grow: %v", err)
	}
	if err := c.Request(ctx, &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	file, _ := os.ReadFile(e.path)
	if len(file) != newSize || string(file[70000:70004]) != "grow" || string(file[newSize-4:]) != "tail" {
		t.Fatalf("file of %d bytes after writes at both ends, want %d with both", len(file), newSize)
	}

	// New opens and the export list see the new size.
	c2, err := e.dial(protocol.ModeReadOnly)
	if err != nil {
		t.Fatal(err)
	}
	if c2.info.VolumeSize != newSize {
		t.Fatalf("a new open reports %d bytes, want %d", c2.info.VolumeSize, newSize)
	}
	var el protocol.ExportList
	if err := c2.Request(ctx, &protocol.ListExports{}, &el); err != nil {
		t.Fatal(err)
	}
	if len(el.Exports) != 1 || el.Exports[0].Size != newSize {
		t.Fatalf("export list %+v, want vol of %d bytes", el.Exports, newSize)
	}

	// The same size: nothing; smaller, unaligned, unknown: refused.
	if err := e.tg.Grow(ctx, "vol", newSize); err != nil {
		t.Fatalf("grow to the same size: %v", err)
	}
	if err := e.tg.Grow(ctx, "vol", oldSize); !errors.Is(err, target.ErrShrink) {
		t.Fatalf("shrink: %v, want ErrShrink", err)
	}
	if err := e.tg.Grow(ctx, "vol", newSize+512); !errors.Is(err, target.ErrBadSize) {
		t.Fatalf("grow by 512 bytes: %v, want ErrBadSize", err)
	}
	if err := e.tg.Grow(ctx, "nope", newSize); !errors.Is(err, protocol.ErrNoExport) {
		t.Fatalf("grow of an unknown export: %v, want ErrNoExport", err)
	}
	select {
	case n := <-notices:
		t.Fatalf("notice %+v after grows that changed nothing", n)
	default:
	}
	if got := counterValue(t, reg, "rblkd_volume_grows_total", "vol"); got != 1 {
		t.Fatalf("rblkd_volume_grows_total{export=vol} = %v, want 1", got)
	}
}

func counterValue(t *testing.T, reg *prometheus.Registry, name, export string) float64 {
	t.Helper()
	return metricstest.Value(t, reg, name, "export", export)
}

// TestGrowReadOnlyExport: rblkd does not write a read-only export's file:
// a grow past its size is refused until the file is enlarged outside.
func TestGrowReadOnlyExport(t *testing.T) {
	e := start(t, true, make([]byte, 64<<10))
	ctx := context.Background()
	if err := e.tg.Grow(ctx, "vol", 128<<10); !errors.Is(err, target.ErrBackingTooSmall) {
		t.Fatalf("grow of a read-only export past its file: %v, want ErrBackingTooSmall", err)
	}
	if err := os.Truncate(e.path, 128<<10); err != nil {
		t.Fatal(err)
	}
	if err := e.tg.Grow(ctx, "vol", 128<<10); err != nil {
		t.Fatalf("grow once the file is enlarged: %v", err)
	}
	c, err := e.dial(protocol.ModeReadOnly)
	if err != nil {
		t.Fatal(err)
	}
	if c.info.VolumeSize != 128<<10 {
		t.Fatalf("size after the grow %d, want %d", c.info.VolumeSize, 128<<10)
	}
}

// TestGrowUnderIO grows a volume step by step while two sessions ask for
// grants all over it and trim near its end (run it with -race): every
// grant is whole for the size the target had (never shorter than the
// chunk unless it is the last one), nothing fails but ranges beyond the
// end, and every session gets every Resize, in order.
func TestGrowUnderIO(t *testing.T) {
	const chunk = 64 << 10
	e, _ := startWith(t, make([]byte, 100<<10), target.Options{CacheSize: 1 << 20, ChunkSize: chunk, DrainTimeout: time.Second},
		target.ExportConfig{Shared: true})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sizes := []int64{160 << 10, 228 << 10, 292 << 10, 400 << 10}
	had := map[uint64]bool{100 << 10: true}
	for _, s := range sizes {
		had[uint64(s)] = true
	}
	type sess struct {
		c       *client
		notices <-chan notice
	}
	var ss []sess
	for range 2 {
		c, n := e.dialNotices(ctx, protocol.ModeReadWrite)
		ss = append(ss, sess{c, n})
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errc := make(chan error, 2)
	for i, s := range ss {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := uint64(0); ; k++ {
				select {
				case <-stop:
					return
				default:
				}
				off := (k*37*1024 + uint64(i)*4096) % (400 << 10)
				var g protocol.Grant
				err := s.c.Request(ctx, &protocol.GrantRequest{Handle: s.c.info.Handle, Flags: protocol.GrantWrite, Offset: off}, &g)
				switch {
				case errors.Is(err, protocol.ErrRange):
				case err != nil:
					errc <- fmt.Errorf("grant at %d: %w", off, err)
					return
				case g.Length != chunk && !had[g.Offset+uint64(g.Length)]:
					errc <- fmt.Errorf("grant %+v: short, and not ending at a size the volume had", g)
					return
				}
				err = s.c.Request(ctx, &protocol.Trim{Handle: s.c.info.Handle, Offset: off &^ 4095, Length: 4096}, &protocol.OK{})
				if err != nil && !errors.Is(err, protocol.ErrRange) {
					errc <- fmt.Errorf("trim at %d: %w", off, err)
					return
				}
			}
		}()
	}
	for _, size := range sizes {
		if err := e.tg.Grow(ctx, "vol", size); err != nil {
			t.Fatal(err)
		}
	}
	// Every session got each Resize, in order (revokes may come between).
	for i, s := range ss {
		for _, size := range sizes {
			for {
				n := next(t, s.notices)
				if n.typ == protocol.TypeRevoke {
					continue
				}
				if n.size != uint64(size) {
					t.Fatalf("session %d: Resize to %d, want %d", i, n.size, size)
				}
				break
			}
		}
	}
	close(stop)
	wg.Wait()
	select {
	case err := <-errc:
		t.Fatal(err)
	default:
	}
	if st, err := os.Stat(e.path); err != nil || st.Size() != sizes[len(sizes)-1] {
		t.Fatalf("backing file %v, %v; want %d bytes", st, err, sizes[len(sizes)-1])
	}
}

// gatedStore holds the first read at off until release is closed,
// signalling entered when it starts waiting.
type gatedStore struct {
	target.Store
	off      int64
	once     sync.Once
	entered  chan struct{}
	released chan struct{}
}

func (g *gatedStore) ReadAt(p []byte, off int64) (int, error) {
	if off == g.off {
		g.once.Do(func() {
			close(g.entered)
			<-g.released
		})
	}
	return g.Store.ReadAt(p, off)
}

// TestGrowDuringLoad: the short last chunk is being loaded (its read held)
// when the volume grows: the grant that waited for the load is of the
// whole chunk, since the new size was in effect before it was answered.
func TestGrowDuringLoad(t *testing.T) {
	const oldSize, newSize = 96 << 10, 256 << 10
	gate := &gatedStore{off: 64 << 10, entered: make(chan struct{}), released: make(chan struct{})}
	e, _ := startWith(t, make([]byte, oldSize), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, DrainTimeout: time.Second,
		WrapStore: func(_ string, f *os.File) target.Store { gate.Store = f; return gate }}, target.ExportConfig{Shared: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, _ := e.dialNotices(ctx, protocol.ModeReadWrite)
	granted := make(chan error, 1)
	var g protocol.Grant
	go func() {
		granted <- c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: 70000}, &g)
	}()
	select {
	case <-gate.entered:
	case <-ctx.Done():
		t.Fatal("the chunk's load did not start")
	}
	grown := make(chan error, 1)
	go func() { grown <- e.tg.Grow(ctx, "vol", newSize) }()
	// The new size is in effect (a new open sees it) while the load is held.
	for {
		c2, err := e.dial(protocol.ModeReadOnly)
		if err != nil {
			t.Fatal(err)
		}
		c2.Close()
		if c2.info.VolumeSize == newSize {
			break
		}
		select {
		case err := <-grown:
			t.Fatalf("Grow returned (%v) while a load of the chunk it must refit was held", err)
		case <-ctx.Done():
			t.Fatal("the new size is not in effect")
		default:
		}
	}
	close(gate.released)
	if err := <-granted; err != nil {
		t.Fatal(err)
	}
	if err := <-grown; err != nil {
		t.Fatal(err)
	}
	if g.Offset != 64<<10 || g.Length != 64<<10 {
		t.Fatalf("grant answered after the grow: %+v, want the whole chunk (64 KiB at 64 KiB)", g)
	}
}

// TestGrowBlockDevice: an export on a block device (a loop device) grows
// only once the device is that large: before, the grow is refused saying
// to enlarge it; after the device grew (losetup -c), it succeeds. Needs
// root and losetup (skipped otherwise).
func TestGrowBlockDevice(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for a loop device")
	}
	if _, err := exec.LookPath("losetup"); err != nil {
		t.Skip("needs losetup (util-linux)")
	}
	img := filepath.Join(t.TempDir(), "backing.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })

	transporttest.CheckGoroutines(t)
	tg, err := target.New(target.Options{Exports: []target.ExportConfig{{Name: "vol", Path: dev}}, CacheSize: 1 << 20, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	ctx := context.Background()
	err = tg.Grow(ctx, "vol", 2<<20)
	if !errors.Is(err, target.ErrBackingTooSmall) || !strings.Contains(err.Error(), dev) || !strings.Contains(err.Error(), "enlarge it first") {
		t.Fatalf("grow past the device: %v, want ErrBackingTooSmall naming %s and what to do", err, dev)
	}
	if err := os.Truncate(img, 2<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("losetup", "-c", dev).CombinedOutput(); err != nil {
		t.Fatalf("losetup -c %s: %v: %s", dev, err, out)
	}
	if err := tg.Grow(ctx, "vol", 2<<20); err != nil {
		t.Fatalf("grow once the device grew: %v", err)
	}
	if err := tg.Grow(ctx, "vol", 3<<20); !errors.Is(err, target.ErrBackingTooSmall) {
		t.Fatalf("grow past the device again: %v, want ErrBackingTooSmall", err)
	}
}
