package kernel

import (
	"context"
	"fmt"

	"go.uber.org/zap"
)

// Resize tells the kernel that the device's volume is now size bytes (it
// grew online): the device's capacity changes at once (NBD_CMD_RECONFIGURE
// with NBD_ATTR_SIZE_BYTES, Linux >= 5.3; the NBD ioctls are refused on a
// device configured over netlink), and udev gets a change event. The
// export must already serve the new size (nbd.Export.CurrentSize): the
// kernel may read the new end at once. size must be a multiple of the
// device's block size.
func (d *Device) Resize(ctx context.Context, size uint64) error {
	if size == 0 || size%uint64(d.blockSize) != 0 {
		return fmt.Errorf("resize %s to %d bytes: not a multiple of its block size %d", d.Path(), size, d.blockSize)
	}
	if err := d.drv.reconfigure(ctx, resizeConfig{Index: d.index, SizeBytes: size, Backend: d.backend}); err != nil {
		return fmt.Errorf("resize %s to %d bytes: %w", d.Path(), size, err)
	}
	d.log.Info("nbd device resized", zap.String("device", d.Path()), zap.Uint64("size", size))
	return nil
}
