//go:build linux

package rdma

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
)

// RemovalTestEnv turns on TestDeviceRemoval, which deletes the RDMA device
// (a Soft-RoCE link): for a throwaway VM only. Soft-RoCE cannot detach a
// process from a device (no disassociate_ucontext), so the deletion ends
// only once the test process exits (librdmacm keeps the device open): the
// caller adds the link back after that.
const RemovalTestEnv = "RBLK_RDMA_REMOVAL_TEST"

// rxeOf returns the RDMA device that has ip, and its network interface.
func rxeOf(t *testing.T, ip string) (dev, netdev string) {
	t.Helper()
	for _, d := range Devices() {
		addrs, err := DeviceAddrs(d)
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if a.String() != ip {
				continue
			}
			nd, _ := filepath.Glob(filepath.Join(SysfsDir, d, "ports", "*", "gid_attrs", "ndevs", "*"))
			for _, f := range nd {
				if b, err := os.ReadFile(f); err == nil && strings.TrimSpace(string(b)) != "" {
					return d, strings.TrimSpace(string(b))
				}
			}
		}
	}
	t.Fatalf("no RDMA device has %s", ip)
	return "", ""
}

// TestDeviceRemoval deletes the Soft-RoCE device under a listener and an
// established connection (rdma link delete): Accept must fail with
// ErrDeviceRemoved (not ErrClosed, which a server takes for an orderly
// stop), and both ends of the connection must break: the posted receive
// completes flushed and Poll reports the end, instead of waiting forever.
//
// Where there is no RDMA device it runs over the fake device, whose
// removal is immediate.
func TestDeviceRemoval(t *testing.T) {
	var p transport.Provider
	var ip string
	var remove func()
	if Supported && len(Devices()) > 0 {
		if os.Getenv(RemovalTestEnv) != "1" {
			t.Skipf("deletes the RDMA device: set %s=1 (in a throwaway VM)", RemovalTestEnv)
		}
		p, ip = testProvider(t, Options{})
		dev, _ := rxeOf(t, ip)
		remove = func() {
			// The deletion finishes after this process exits (see
			// RemovalTestEnv): it is not waited for.
			del := exec.Command("rdma", "link", "delete", dev)
			if err := del.Start(); err != nil {
				t.Fatalf("rdma link delete %s: %v", dev, err)
			}
		}
	} else {
		f := newFakeFabric(t)
		p, ip = newFakeProvider(t, f, Options{}), fakeAddr.String()
		remove = f.removeDevice
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	l, err := p.Listen(ctx, net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	type dialed struct {
		c   transport.Conn
		err error
	}
	dc := make(chan dialed, 1)
	go func() {
		c, err := p.Dial(ctx, l.Addr(), nil)
		dc <- dialed{c, err}
	}()
	req, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b, err := req.Accept(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	d := <-dc
	if d.err != nil {
		t.Fatal(d.err)
	}
	a := d.c
	defer a.Close()
	mem, err := transport.AllocMemory(4096, false)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	rb, err := b.Register(mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.PostRecv(transport.RecvRequest{ID: 7, Local: transport.SGE{Region: rb, Length: 4096}}); err != nil {
		t.Fatal(err)
	}

	acceptErr := make(chan error, 1)
	go func() {
		_, err := l.Accept(ctx)
		l.Close() // what a server does next: release the device
		acceptErr <- err
	}()
	type ended struct {
		comps []transport.Completion
		err   error
	}
	drain := func(c transport.Conn) chan ended {
		ch := make(chan ended, 1)
		go func() {
			var got []transport.Completion
			buf := make([]transport.Completion, 8)
			for {
				n, err := c.Poll(ctx, buf)
				got = append(got, buf[:n]...)
				if err != nil {
					ch <- ended{got, err}
					return
				}
			}
		}()
		return ch
	}
	aEnd, bEnd := drain(a), drain(b)

	remove()

	select {
	case err := <-acceptErr:
		if !errors.Is(err, transport.ErrDeviceRemoved) || errors.Is(err, transport.ErrClosed) {
			t.Errorf("accept when the device was removed: %v, want ErrDeviceRemoved, not ErrClosed", err)
		}
		t.Logf("accept: %v", err)
	case <-ctx.Done():
		t.Fatal("accept did not return after the device was removed")
	}
	for _, side := range []struct {
		name string
		ch   chan ended
	}{{"acceptor", bEnd}, {"dialer", aEnd}} {
		select {
		case e := <-side.ch:
			if !errors.Is(e.err, transport.ErrClosed) {
				t.Errorf("%s: poll ended with %v, want ErrClosed", side.name, e.err)
			}
			t.Logf("%s: %+v, then %v", side.name, e.comps, e.err)
			if side.name == "acceptor" && (len(e.comps) != 1 || e.comps[0].ID != 7 || e.comps[0].Status != transport.StatusFlushed) {
				t.Errorf("acceptor: completions %+v, want receive 7 flushed", e.comps)
			}
		case <-ctx.Done():
			t.Fatalf("%s: poll still waiting after the device was removed", side.name)
		}
	}
	// Close returns: the conns released their resources already.
	a.Close()
	b.Close()
}
