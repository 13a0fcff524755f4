package kernel

import (
	"bytes"
	"context"
	"errors"
	"syscall"
	"testing"

	"go.uber.org/zap/zaptest"
)

// reconfigure records the resize, or fails with reconfigureErr.
func (k *fakeKernel) reconfigure(_ context.Context, c resizeConfig) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.reconfigureErr != nil {
		return k.reconfigureErr
	}
	k.resizes = append(k.resizes, c)
	return nil
}

// The NBD_CMD_RECONFIGURE of a resize: the index, the size and the
// backend identifier the device was attached with (the kernel refuses a
// reconfigure of such a device without it).
func TestEncodeResize(t *testing.T) {
	got, err := encodeResize(resizeConfig{Index: 5, SizeBytes: 2 << 20, Backend: "rblk"})
	if err != nil {
		t.Fatal(err)
	}
	if littleEndian {
		want := unhex(t, "08 00 01 00  05 00 00 00"+ // NBD_ATTR_INDEX 5
			"0c 00 02 00  00 00 20 00 00 00 00 00"+ // NBD_ATTR_SIZE_BYTES 2 MiB
			"09 00 0a 00  72 62 6c 6b 00 00 00 00") // NBD_ATTR_BACKEND_IDENTIFIER "rblk\0", padded
		if !bytes.Equal(got, want) {
			t.Errorf("NBD_CMD_RECONFIGURE attributes:\n got %x\nwant %x", got, want)
		}
	}
	back, err := decodeConnect(got) // the same attributes
	if err != nil || back.Index != 5 || back.SizeBytes != 2<<20 || back.Backend != "rblk" {
		t.Errorf("parsed back: %+v, %v", back, err)
	}
	for _, c := range []resizeConfig{{Index: -1, SizeBytes: 4096}, {Index: 1}} {
		if _, err := encodeResize(c); err == nil {
			t.Errorf("encodeResize(%+v): no error", c)
		}
	}
}

// Device.Resize hands the kernel the new size with the device's index and
// backend identifier; a size that is not a multiple of the device's block
// size is refused before; the kernel's refusal comes back worded.
func TestDeviceResize(t *testing.T) {
	be := newMemBackend(2 << 20)
	k := newFakeKernel(t)
	dev, err := attach(context.Background(), Options{Export: testExport(be), Connections: 1, Device: "/dev/nbd3",
		Backend: "rblk:vol@t", Logger: zaptest.NewLogger(t)}, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Detach(context.Background())
	ctx := context.Background()
	if err := dev.Resize(ctx, 2<<20); err != nil {
		t.Fatal(err)
	}
	if err := dev.Resize(ctx, 2<<20+512); err == nil {
		t.Error("resize to a size that is not a multiple of 4096: no error")
	}
	k.mu.Lock()
	k.reconfigureErr = kernelErr("NBD_CMD_RECONFIGURE", syscall.EINVAL)
	k.mu.Unlock()
	if err := dev.Resize(ctx, 4<<20); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("the kernel's refusal: %v", err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.resizes) != 1 || k.resizes[0] != (resizeConfig{Index: 3, SizeBytes: 2 << 20, Backend: "rblk:vol@t"}) {
		t.Errorf("NBD_CMD_RECONFIGURE calls %+v", k.resizes)
	}
}
