package transport

import (
	"errors"
	"fmt"
)

// CheckBind checks the arguments of WindowBinder.BindWindow against the
// region r (already known to be the Conn's own), for providers: the
// rights asked for, the region's rights, and the span.
func CheckBind(r Region, off, length int, access Access) error {
	const remote = AccessRemoteRead | AccessRemoteWrite
	ra, n := r.Access(), len(r.Bytes())
	switch {
	case access == 0 || access&^remote != 0:
		return fmt.Errorf("bind window: access %v: want remote-read, remote-write or both", access)
	case ra&AccessBindWindow == 0:
		return fmt.Errorf("bind window: the region was registered with %v, without bind-window", ra)
	case access&AccessRemoteWrite != 0 && ra&AccessLocalWrite == 0:
		return errors.New("bind window: a writable window needs a region with local write access")
	case off < 0 || length <= 0 || off > n || length > n-off:
		return fmt.Errorf("bind window: span [%d, %d+%d) outside the region of %d bytes", off, off, length, n)
	}
	return nil
}
