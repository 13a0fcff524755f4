package target_test

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
)

// openNotified connects as host, opens export name read-write and returns
// the client and the notices (Errors of tag 0) the target sends it.
func (e *env) openNotified(host, name string) (*client, <-chan protocol.ErrorMsg, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	notices := make(chan protocol.ErrorMsg, 4)
	l, err := link.Dial(ctx, e.p, e.addr, link.Options{Handler: func(h protocol.Header, p []byte) {
		var em protocol.ErrorMsg
		if h.Type == protocol.TypeError && h.Tag == 0 && em.Unmarshal(p) == nil {
			select {
			case notices <- em:
			default:
			}
		}
	}})
	if err != nil {
		return nil, nil, err
	}
	e.t.Cleanup(func() { l.Close() })
	c := &client{Link: l}
	if _, err := auth.Initiate(ctx, l, host, nil); err != nil {
		return nil, nil, err
	}
	return c, notices, l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadWrite, Name: name, HostID: host}, &c.info)
}

func (c *client) grantOK(off uint64) error {
	var g protocol.Grant
	return c.Request(context.Background(), &protocol.GrantRequest{Handle: c.info.Handle, Offset: off}, &g)
}

// TestRemoveExport: removing an export tells its session with a shutdown
// notice, ends it, writes what it left dirty (reported with Done, never
// flushed) to the backing file, and refuses new opens of it; the session of
// the other export goes on untouched.
func TestRemoveExport(t *testing.T) {
	// No background write-back: only the removal writes what is dirty.
	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10,
		DrainTimeout: 200 * time.Millisecond, WritebackDelay: time.Hour}, target.ExportConfig{})
	ctx := context.Background()
	otherPath := filepath.Join(t.TempDir(), "other.img")
	if err := e.tg.AddExport(ctx, target.ExportConfig{Name: "other", Path: otherPath, Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := e.tg.AddExport(ctx, target.ExportConfig{Name: "other", Path: otherPath}); !errors.Is(err, target.ErrExportExists) {
		t.Fatalf("AddExport of an existing name: %v, want ErrExportExists", err)
	}
	keep, _, err := e.openNotified("host-a", "vol")
	if err != nil {
		t.Fatal(err)
	}
	gone, notices, err := e.openNotified("host-b", "other")
	if err != nil {
		t.Fatal(err)
	}
	data := []byte("written before the removal, never flushed")
	if err := gone.writeChunk(t, 4096+100, data, gone.info.Generation); err != nil {
		t.Fatal(err)
	}
	if err := keep.writeChunk(t, 8192, []byte("kept"), keep.info.Generation); err != nil {
		t.Fatal(err)
	}
	if st := e.tg.Exports(); len(st) != 2 || st[0].Config.Name != "other" || st[0].Sessions != 1 || st[0].Writers != 1 || st[0].Size != 1<<20 {
		t.Fatalf("Exports before removal: %+v", st)
	}

	// The client ignores the notice (sends no Flush): the target closes
	// it after DrainTimeout and writes back what it reported.
	if err := e.tg.RemoveExport(ctx, "other"); err != nil {
		t.Fatal(err)
	}
	select {
	case em := <-notices:
		if em.Code != protocol.CodeShutdown {
			t.Fatalf("notice %+v, want CodeShutdown", em)
		}
	default:
		t.Fatal("the removed export's session got no shutdown notice")
	}
	waitDown(t, gone.Link, "removed export's session")
	if got := readFile(t, otherPath)[4096+100:][:len(data)]; !bytes.Equal(got, data) {
		t.Fatalf("removed export's file holds %q, want %q", got, data)
	}
	if keep.Err() != nil {
		t.Fatalf("the other export's session was touched: %v", keep.Err())
	}
	if err := keep.grantOK(0); err != nil {
		t.Fatalf("grant on the other export after the removal: %v", err)
	}
	if st := e.tg.Exports(); len(st) != 1 || st[0].Config.Name != "vol" || st[0].Sessions != 1 {
		t.Fatalf("Exports after removal: %+v", st)
	}
	if _, _, err := e.openNotified("host-b", "other"); !errors.Is(err, protocol.ErrNoExport) {
		t.Fatalf("open of a removed export: %v, want ErrNoExport", err)
	}
	if err := e.tg.RemoveExport(ctx, "other"); !errors.Is(err, target.ErrNoExport) {
		t.Fatalf("RemoveExport twice: %v, want ErrNoExport", err)
	}
	// Added again under the same name: served again, with the data.
	if err := e.tg.AddExport(ctx, target.ExportConfig{Name: "other", Path: otherPath}); err != nil {
		t.Fatal(err)
	}
	again, _, err := e.openNotified("host-b", "other")
	if err != nil {
		t.Fatalf("open of the export added again: %v", err)
	}
	var g protocol.Grant
	if err := again.Request(ctx, &protocol.GrantRequest{Handle: again.info.Handle, Offset: 4096}, &g); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if err := again.rdma(ctx, false, g, 4096+100-g.Offset, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("export added again reads %q, want %q", got, data)
	}
}

// TestRemoveExportFlushingInitiator: an initiator that answers the notice
// as rblk-attach does (Flush, then disconnect) ends before DrainTimeout.
func TestRemoveExportFlushingInitiator(t *testing.T) {
	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10,
		DrainTimeout: time.Minute}, target.ExportConfig{})
	ctx := context.Background()
	c, notices, err := e.openNotified("host-a", "vol")
	if err != nil {
		t.Fatal(err)
	}
	data := []byte("flushed on the notice")
	if err := c.writeChunk(t, 0, data, c.info.Generation); err != nil {
		t.Fatal(err)
	}
	removed := make(chan error, 1)
	go func() { removed <- e.tg.RemoveExport(ctx, "vol") }()
	em := <-notices
	if em.Code != protocol.CodeShutdown {
		t.Fatalf("notice %+v", em)
	}
	if err := c.Request(ctx, &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatalf("flush during the drain: %v", err)
	}
	c.Close()
	select {
	case err := <-removed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("RemoveExport did not return once its only session left")
	}
	if got := readFile(t, e.path)[:len(data)]; !bytes.Equal(got, data) {
		t.Fatalf("file holds %q, want %q", got, data)
	}
	if st := e.tg.Exports(); len(st) != 0 {
		t.Fatalf("Exports after removing the only one: %+v", st)
	}
}

// TestUpdateExport: the allow list changes live (hosts no longer allowed
// are drained, the others untouched); path and read_only are refused
// naming the field; a smaller size is refused.
func TestUpdateExport(t *testing.T) {
	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10,
		DrainTimeout: 200 * time.Millisecond}, target.ExportConfig{Shared: true})
	ctx := context.Background()
	a, _, err := e.openNotified("host-a", "vol")
	if err != nil {
		t.Fatal(err)
	}
	b, bNotices, err := e.openNotified("host-b", "vol")
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.tg.Exports()[0].Config
	for _, c := range []struct {
		name string
		edit func(*target.ExportConfig)
		want error
		text string
	}{
		{"path", func(c *target.ExportConfig) { c.Path += ".new" }, target.ErrNotLive, "path"},
		{"read_only", func(c *target.ExportConfig) { c.ReadOnly = true }, target.ErrNotLive, "read_only"},
		{"shrink", func(c *target.ExportConfig) { c.Size = 4096 }, target.ErrShrink, "size 4096"},
		{"unknown", func(c *target.ExportConfig) { c.Name = "nope" }, target.ErrNoExport, "nope"},
	} {
		n := cfg
		c.edit(&n)
		err := e.tg.UpdateExport(ctx, n)
		if !errors.Is(err, c.want) || !bytes.Contains([]byte(err.Error()), []byte(c.text)) {
			t.Errorf("%s: UpdateExport: %v, want %v naming %q", c.name, err, c.want, c.text)
		}
	}
	if a.Err() != nil || b.Err() != nil {
		t.Fatal("a refused update touched the sessions")
	}
	n := cfg
	n.Allow = []string{"host-a"}
	n.Shared = false
	if err := e.tg.UpdateExport(ctx, n); err != nil {
		t.Fatal(err)
	}
	waitDown(t, b.Link, "session of a host no longer allowed")
	if em := <-bNotices; em.Code != protocol.CodeShutdown {
		t.Fatalf("notice %+v", em)
	}
	if err := a.grantOK(0); err != nil || a.Err() != nil {
		t.Fatalf("the allowed host's session after the update: %v, %v", err, a.Err())
	}
	st := e.tg.Exports()[0]
	if st.Sessions != 1 || st.Config.Shared || len(st.Config.Allow) != 1 {
		t.Fatalf("status after the update: %+v", st)
	}
	if _, _, err := e.openNotified("host-b", "vol"); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("open by a host no longer allowed: %v, want ErrAccess", err)
	}
}
