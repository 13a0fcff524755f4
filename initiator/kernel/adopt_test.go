package kernel

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

// stat is what the fake's last connect made: attached until a disconnect.
func (k *fakeKernel) stat(index int) (*Status, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	st := &Status{Index: index, Path: DevicePath(index)}
	if k.connects > 0 && k.disconnects == 0 {
		st.Attached, st.PID, st.Backend, st.Size = true, 4242, k.cfg.Backend, k.cfg.SizeBytes
	}
	return st, nil
}

func (k *fakeKernel) connections(int) (int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.cur), nil
}

// adopt replaces dead sockets with the new ones, in order, and drops
// those beyond, as nbd_reconnect_socket does.
func (k *fakeKernel) adopt(_ context.Context, c adoptConfig) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.adopts = append(k.adopts, c)
	fds := c.FDs
	if k.adoptTakesNone {
		fds = nil
	}
	for i, s := range k.cur {
		if len(fds) == 0 {
			break
		}
		if !s.isDead() {
			continue
		}
		ns := newFakeSock(k.t, k.ends[fds[0]], true)
		k.socks = append(k.socks, ns)
		k.cur[i] = ns
		fds = fds[1:]
	}
	if c.SizeBytes != 0 {
		k.cfg.SizeBytes = c.SizeBytes
	}
	return nil
}

// die ends dev's side as the death of its process would: its sockets
// close, nothing is disconnected.
func die(t *testing.T, dev *Device) {
	t.Helper()
	for _, c := range dev.conns {
		c.Close()
	}
	select {
	case <-dev.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the device's connections did not end")
	}
	dev.cancel()
}

// waitDead waits until the fake kernel saw every socket of its last
// connect close.
func waitDead(t *testing.T, k *fakeKernel) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if n, _ := k.receivers(0); n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the fake kernel still reads the dead server's sockets")
		}
		time.Sleep(time.Millisecond)
	}
}

// The NBD_CMD_RECONFIGURE of an adoption: index, both timeouts, the
// backend identifier and the sockets; the size only when it grows.
func TestEncodeAdopt(t *testing.T) {
	got, err := encodeAdopt(adoptConfig{Index: 2, Backend: "rblk", Timeout: 90 * time.Second, DeadConnTimeout: 2 * time.Minute, FDs: []int{5, 6}})
	if err != nil {
		t.Fatal(err)
	}
	if littleEndian {
		want := unhex(t, "08 00 01 00  02 00 00 00"+ // NBD_ATTR_INDEX 2
			"0c 00 04 00  5a 00 00 00 00 00 00 00"+ // NBD_ATTR_TIMEOUT 90 s
			"0c 00 08 00  78 00 00 00 00 00 00 00"+ // NBD_ATTR_DEAD_CONN_TIMEOUT 120 s
			"09 00 0a 00  72 62 6c 6b 00 00 00 00"+ // NBD_ATTR_BACKEND_IDENTIFIER "rblk\0", padded
			"1c 00 07 80"+ // NBD_ATTR_SOCKETS, nested
			"0c 00 01 80  08 00 01 00 05 00 00 00"+ // NBD_SOCK_ITEM { NBD_SOCK_FD 5 }
			"0c 00 01 80  08 00 01 00 06 00 00 00") // NBD_SOCK_ITEM { NBD_SOCK_FD 6 }
		if !bytes.Equal(got, want) {
			t.Errorf("NBD_CMD_RECONFIGURE attributes:\n got %x\nwant %x", got, want)
		}
	}
	back, err := decodeConnect(got) // the same attributes
	if err != nil || back.Index != 2 || back.SizeBytes != 0 || back.Backend != "rblk" || back.Timeout != 90*time.Second ||
		back.DeadConnTimeout != 2*time.Minute || len(back.FDs) != 2 || back.FDs[0] != 5 || back.FDs[1] != 6 {
		t.Errorf("parsed back: %+v, %v", back, err)
	}
	grown, err := encodeAdopt(adoptConfig{Index: 2, Backend: "rblk", SizeBytes: 4 << 20, FDs: []int{5}})
	if err != nil {
		t.Fatal(err)
	}
	if back, err := decodeConnect(grown); err != nil || back.SizeBytes != 4<<20 {
		t.Errorf("a growth parsed back: %+v, %v", back, err)
	}
	for _, c := range []adoptConfig{{Index: -1, FDs: []int{1}}, {Index: 1}, {Index: 1, FDs: []int{-1}}} {
		if _, err := encodeAdopt(c); err == nil {
			t.Errorf("encodeAdopt(%+v): no error", c)
		}
	}
}

// A device whose server died is adopted by a new one: it gets as many
// sockets as the device had, the data written through the dead server is
// read through the new one, and the reconfigure carries the new server's
// timeouts and backend identifier. Before the death the adoption is
// refused (ErrServed), as it is for another backend identifier, a smaller
// volume, a device not attached, or "auto".
func TestAdopt(t *testing.T) {
	be := newMemBackend(1 << 20)
	k := newFakeKernel(t)
	opts := Options{Export: testExport(be), Connections: 2, Device: "/dev/nbd4", Backend: "rblk:vol@t",
		DeadConnTimeout: time.Minute, Logger: zaptest.NewLogger(t)}
	ctx := context.Background()
	if _, err := adopt(ctx, opts, k, k.pair, k.closeFD); !errors.Is(err, ErrNotAttached) {
		t.Fatalf("adopt of a device not attached: %v", err)
	}
	dev, err := attach(ctx, opts, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte{0x5a}, 4096)
	sock := k.cur[1]
	if r := sock.wait(sock.send(nbdCmdWrite, 0, 8192, 4096, payload)); r.errno != 0 {
		t.Fatalf("write: errno %d", r.errno)
	}
	if _, err := adopt(ctx, opts, k, k.pair, k.closeFD); !errors.Is(err, ErrServed) {
		t.Fatalf("adopt of a device served: %v", err)
	}

	die(t, dev)
	waitDead(t, k)
	for name, o := range map[string]Options{
		"another backend": {Export: opts.Export, Device: opts.Device, Backend: "rblk:other@t"},
		"auto":            {Export: opts.Export, Device: "auto", Backend: opts.Backend},
	} {
		if _, err := adopt(ctx, o, k, k.pair, k.closeFD); err == nil {
			t.Errorf("adopt, %s: no error", name)
		}
	}
	small := *opts.Export
	small.Size = 512 << 10
	if _, err := adopt(ctx, Options{Export: &small, Device: opts.Device, Backend: opts.Backend}, k, k.pair, k.closeFD); err == nil {
		t.Error("adopt with a smaller volume: no error")
	}
	if len(k.adopts) != 0 {
		t.Fatalf("refused adoptions reached the kernel: %+v", k.adopts)
	}

	grown := *opts.Export
	grown.Size = 2 << 20
	opts.Export = &grown
	opts.Timeout = 90 * time.Second
	dev2, err := adopt(ctx, opts, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	if dev2.Path() != "/dev/nbd4" || dev2.Connections() != 2 {
		t.Errorf("adopted %s with %d sockets", dev2.Path(), dev2.Connections())
	}
	k.mu.Lock()
	got := k.adopts
	k.mu.Unlock()
	if len(got) != 1 || got[0].Index != 4 || got[0].Backend != "rblk:vol@t" || got[0].SizeBytes != 2<<20 ||
		got[0].Timeout != 90*time.Second || got[0].DeadConnTimeout != time.Minute || len(got[0].FDs) != 2 {
		t.Errorf("NBD_CMD_RECONFIGURE calls %+v", got)
	}
	for i := range 2 {
		s := k.cur[i]
		if s.isDead() {
			t.Fatalf("socket %d still the dead one", i)
		}
		r := s.wait(s.send(nbdCmdRead, 0, 8192, 4096, nil))
		if r.errno != 0 || !bytes.Equal(r.data, payload) {
			t.Errorf("read through adopted socket %d: errno %d, data %x...", i, r.errno, r.data[:min(8, len(r.data))])
		}
	}
	if err := dev2.Detach(ctx); err != nil {
		t.Fatal(err)
	}
}

// An adoption the kernel takes no socket of (their server came back in
// between, or the kernel refused them all) fails, and stops serving.
func TestAdoptNoSocketTaken(t *testing.T) {
	shortReceiversWait(t, 50*time.Millisecond)
	be := newMemBackend(1 << 20)
	k := newFakeKernel(t)
	opts := Options{Export: testExport(be), Connections: 1, Device: "/dev/nbd1", Backend: "rblk:vol@t", Logger: zaptest.NewLogger(t)}
	ctx := context.Background()
	dev, err := attach(ctx, opts, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	die(t, dev)
	waitDead(t, k)
	k.mu.Lock()
	k.adoptTakesNone = true
	k.mu.Unlock()
	if _, err := adopt(ctx, opts, k, k.pair, k.closeFD); !errors.Is(err, ErrServed) {
		t.Fatalf("adopt with no socket taken: %v", err)
	}
}
