package target_test

import (
	"context"
	"errors"
	"testing"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/target"
)

// TestPrivateExportAdmitsOnlyItsHosts: a Private export with an empty
// allow list admits no host; one on the list opens it.
func TestPrivateExportAdmitsOnlyItsHosts(t *testing.T) {
	e := fenceEnvWith(t, target.ExportConfig{Private: true})
	if _, err := e.openAs("host-a", nil, protocol.ModeReadOnly, 0); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("open of a private export published to nobody: %v, want ErrAccess", err)
	}
	cfg := e.tg.Exports()[0].Config
	cfg.Allow = []string{"host-a"}
	if err := e.tg.UpdateExport(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	a, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatalf("open by the host it was published to: %v", err)
	}
	defer a.Close()
	if _, err := e.openAs("host-b", nil, protocol.ModeReadOnly, 0); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("open by a host it was not published to: %v, want ErrAccess", err)
	}
}

// TestFenceHost: FenceHost returns once the host's sessions are fenced:
// its old key no longer writes, its reopen is refused, the bytes stay;
// another host keeps its session.
func TestFenceHost(t *testing.T) {
	content := fenceContent()
	e := fenceEnvWith(t, target.ExportConfig{Private: true, Shared: true, Allow: []string{"host-a", "host-b", "checker"}})
	a, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.openAs("host-b", nil, protocol.ModeReadWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := a.writeChunk(t, 0, []byte("written by A!!"), a.info.Generation); err != nil {
		t.Fatal(err)
	}
	n, err := e.tg.FenceHost(context.Background(), "vol", "host-a")
	if err != nil || n != 1 {
		t.Fatalf("FenceHost: %d sessions, %v; want 1, nil", n, err)
	}
	waitDown(t, a.Link, "the fenced host")
	if _, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0); !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("reopen by the fenced host: %v, want ErrAccess", err)
	}
	if got := e.tg.Exports()[0].Config.Allow; len(got) != 2 || got[0] != "host-b" {
		t.Fatalf("allow list after FenceHost: %q, want [host-b checker]", got)
	}
	// host-b was not touched.
	grantOf(t, b, fenceChunk, false)
	// What A wrote before it was fenced stays.
	chunkHolds(t, e, 0, append([]byte("written by A!!"), content[14:fenceChunk]...))
	if n, err := e.tg.FenceHost(context.Background(), "vol", "host-a"); err != nil || n != 0 {
		t.Fatalf("FenceHost again: %d, %v; want 0, nil", n, err)
	}
	if _, err := e.tg.FenceHost(context.Background(), "nope", "host-a"); !errors.Is(err, target.ErrNoExport) {
		t.Fatalf("FenceHost of an unknown export: %v, want ErrNoExport", err)
	}
}

// TestFenceHostNeedsPrivate: an export open to every host cannot take one
// off.
func TestFenceHostNeedsPrivate(t *testing.T) {
	e := fenceEnvWith(t, target.ExportConfig{Allow: []string{"host-a"}})
	if _, err := e.tg.FenceHost(context.Background(), "vol", "host-a"); !errors.Is(err, target.ErrNotPrivate) {
		t.Fatalf("FenceHost on an export that is not private: %v, want ErrNotPrivate", err)
	}
	if got := e.tg.Exports()[0].Config.Allow; len(got) != 1 {
		t.Fatalf("allow list changed by a refused FenceHost: %q", got)
	}
}

// TestFenceHostRacesOpen: an Open of the host that passed the export's
// checks before FenceHost changed the allow list, and adds its handle
// after FenceHost returned, is refused: no session of the host has the
// export once both are over.
func TestFenceHostRacesOpen(t *testing.T) {
	e := fenceEnvWith(t, target.ExportConfig{Private: true, Allow: []string{"host-a"}})
	inWindow, release := make(chan struct{}), make(chan struct{})
	target.SetTestHookOpening(func(host string) {
		if host == "host-a" {
			close(inWindow)
			<-release
		}
	})
	defer target.SetTestHookOpening(nil)
	opened := make(chan error, 1)
	go func() {
		c, err := e.openAs("host-a", nil, protocol.ModeReadWrite, 0)
		if err == nil {
			defer c.Close()
		}
		opened <- err
	}()
	<-inWindow
	if _, err := e.tg.FenceHost(context.Background(), "vol", "host-a"); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-opened; !errors.Is(err, protocol.ErrAccess) {
		t.Fatalf("an Open that raced FenceHost: %v, want ErrAccess", err)
	}
	if st := e.tg.Exports()[0]; st.Sessions != 0 {
		t.Fatalf("%d sessions have the export after FenceHost and the Open that raced it", st.Sessions)
	}
}

func fenceEnvWith(t *testing.T, x target.ExportConfig) *env {
	e, _ := startWith(t, fenceContent(), target.Options{CacheSize: 1 << 20, ChunkSize: fenceChunk}, x)
	return e
}
