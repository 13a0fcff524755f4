package kernel

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/mdlayher/netlink"
)

// The generic netlink interface of the kernel's NBD driver, as defined in
// include/uapi/linux/nbd-netlink.h.
const (
	genlFamilyName = "nbd"
	genlVersion    = 0x1

	// Commands.
	nbdCmdConnect     = 1
	nbdCmdDisconnect  = 2
	nbdCmdReconfigure = 3
	nbdCmdLinkDead    = 4
	nbdCmdStatus      = 5

	// Attributes of the commands (nbd_attr_policy: INDEX is NLA_U32,
	// SOCKETS and DEVICE_LIST are nested, BACKEND_IDENTIFIER a string, the
	// others NLA_U64; TIMEOUT and DEAD_CONN_TIMEOUT are in seconds).
	nbdAttrIndex             = 1
	nbdAttrSizeBytes         = 2
	nbdAttrBlockSizeBytes    = 3
	nbdAttrTimeout           = 4
	nbdAttrServerFlags       = 5
	nbdAttrClientFlags       = 6
	nbdAttrSockets           = 7
	nbdAttrDeadConnTimeout   = 8
	nbdAttrDeviceList        = 9
	nbdAttrBackendIdentifier = 10

	// NBD_ATTR_SOCKETS holds NBD_SOCK_ITEMs, each holding an NBD_SOCK_FD
	// (NLA_U32).
	nbdSockItem = 1
	nbdSockFD   = 1

	// NBD_ATTR_DEVICE_LIST (the reply of NBD_CMD_STATUS) holds
	// NBD_DEVICE_ITEMs, each with NBD_DEVICE_INDEX (u32) and
	// NBD_DEVICE_CONNECTED (u8).
	nbdDeviceItem      = 1
	nbdDeviceIndex     = 1
	nbdDeviceConnected = 2
)

// Transmission flags of the NBD protocol, passed to the kernel as
// NBD_ATTR_SERVER_FLAGS (include/uapi/linux/nbd.h, and the protocol
// specification for those the kernel's header lacks).
const (
	FlagHasFlags        = 1 << 0
	FlagReadOnly        = 1 << 1
	FlagSendFlush       = 1 << 2
	FlagSendFUA         = 1 << 3
	FlagRotational      = 1 << 4
	FlagSendTrim        = 1 << 5
	FlagSendWriteZeroes = 1 << 6
	FlagCanMultiConn    = 1 << 8
)

// Client flags (NBD_ATTR_CLIENT_FLAGS). Neither is used: the device must
// outlive neither a close by its last opener nor a disconnect.
const (
	clientFlagDestroyOnDisconnect = 1 << 0
	clientFlagDisconnectOnClose   = 1 << 1
)

// connectConfig is the content of one NBD_CMD_CONNECT.
type connectConfig struct {
	// Index is the device number, or -1 to let the kernel take the first
	// free device (NBD_ATTR_INDEX is then left out).
	Index           int
	SizeBytes       uint64
	BlockSizeBytes  uint64
	Timeout         time.Duration // whole seconds on the wire
	DeadConnTimeout time.Duration // whole seconds on the wire
	ServerFlags     uint64
	ClientFlags     uint64
	// Backend is NBD_ATTR_BACKEND_IDENTIFIER, shown in
	// /sys/block/nbdN/backend; left out when empty.
	Backend string
	// FDs are the kernel's ends of the sockets.
	FDs []int
}

// seconds rounds d up to whole seconds, the unit of the NBD timeouts.
func seconds(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64((d + time.Second - 1) / time.Second)
}

// encodeConnect builds the attributes of NBD_CMD_CONNECT.
func encodeConnect(c connectConfig) ([]byte, error) {
	if len(c.FDs) == 0 {
		return nil, errors.New("no socket to hand to the kernel")
	}
	ae := netlink.NewAttributeEncoder()
	if c.Index >= 0 {
		if c.Index > math.MaxInt32 {
			return nil, fmt.Errorf("device index %d out of range", c.Index)
		}
		ae.Uint32(nbdAttrIndex, uint32(c.Index))
	}
	ae.Uint64(nbdAttrSizeBytes, c.SizeBytes)
	ae.Uint64(nbdAttrBlockSizeBytes, c.BlockSizeBytes)
	ae.Uint64(nbdAttrTimeout, seconds(c.Timeout))
	ae.Uint64(nbdAttrServerFlags, c.ServerFlags)
	if c.ClientFlags != 0 {
		ae.Uint64(nbdAttrClientFlags, c.ClientFlags)
	}
	ae.Uint64(nbdAttrDeadConnTimeout, seconds(c.DeadConnTimeout))
	if c.Backend != "" {
		ae.String(nbdAttrBackendIdentifier, c.Backend)
	}
	encodeSockets(ae, c.FDs)
	return ae.Encode()
}

// decodeConnect parses what encodeConnect built, the way the kernel reads
// it; for tests and debugging.
func decodeConnect(b []byte) (connectConfig, error) {
	c := connectConfig{Index: -1}
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return c, err
	}
	for ad.Next() {
		switch ad.Type() {
		case nbdAttrIndex:
			c.Index = int(ad.Uint32())
		case nbdAttrSizeBytes:
			c.SizeBytes = ad.Uint64()
		case nbdAttrBlockSizeBytes:
			c.BlockSizeBytes = ad.Uint64()
		case nbdAttrTimeout:
			c.Timeout = time.Duration(ad.Uint64()) * time.Second
		case nbdAttrServerFlags:
			c.ServerFlags = ad.Uint64()
		case nbdAttrClientFlags:
			c.ClientFlags = ad.Uint64()
		case nbdAttrDeadConnTimeout:
			c.DeadConnTimeout = time.Duration(ad.Uint64()) * time.Second
		case nbdAttrBackendIdentifier:
			c.Backend = ad.String()
		case nbdAttrSockets:
			ad.Nested(func(items *netlink.AttributeDecoder) error {
				for items.Next() {
					if items.Type() != nbdSockItem {
						return fmt.Errorf("attribute %d in NBD_ATTR_SOCKETS, want NBD_SOCK_ITEM", items.Type())
					}
					items.Nested(func(s *netlink.AttributeDecoder) error {
						for s.Next() {
							if s.Type() == nbdSockFD {
								c.FDs = append(c.FDs, int(s.Uint32()))
							}
						}
						return nil
					})
				}
				return nil
			})
		}
	}
	return c, ad.Err()
}

// encodeIndex builds the attributes of NBD_CMD_DISCONNECT and of a
// NBD_CMD_STATUS for one device: just NBD_ATTR_INDEX.
func encodeIndex(index int) ([]byte, error) {
	if index < 0 || index > math.MaxInt32 {
		return nil, fmt.Errorf("device index %d out of range", index)
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(nbdAttrIndex, uint32(index))
	return ae.Encode()
}

// decodeIndex finds NBD_ATTR_INDEX in the reply of NBD_CMD_CONNECT.
func decodeIndex(b []byte) (int, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return -1, err
	}
	index := -1
	for ad.Next() {
		if ad.Type() == nbdAttrIndex {
			index = int(ad.Uint32())
		}
	}
	if err := ad.Err(); err != nil {
		return -1, err
	}
	if index < 0 {
		return -1, errors.New("the kernel's reply to NBD_CMD_CONNECT has no NBD_ATTR_INDEX")
	}
	return index, nil
}

// resizeConfig is the content of the NBD_CMD_RECONFIGURE that changes a
// live device's size. The kernel takes NBD_ATTR_SIZE_BYTES in a
// reconfigure since Linux 5.3 (nbd_genl_reconfigure calls
// nbd_genl_size_set, which calls set_capacity_and_notify: the disk's size
// changes at once and udev gets a change event with RESIZE=1); a device
// attached with a backend identifier must name it again (else EINVAL,
// "must specify backend").
type resizeConfig struct {
	Index     int
	SizeBytes uint64
	Backend   string
}

// encodeResize builds the attributes of that NBD_CMD_RECONFIGURE.
func encodeResize(c resizeConfig) ([]byte, error) {
	if c.Index < 0 || c.Index > math.MaxInt32 {
		return nil, fmt.Errorf("device index %d out of range", c.Index)
	}
	if c.SizeBytes == 0 {
		return nil, errors.New("resize to 0 bytes")
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(nbdAttrIndex, uint32(c.Index))
	ae.Uint64(nbdAttrSizeBytes, c.SizeBytes)
	if c.Backend != "" {
		ae.String(nbdAttrBackendIdentifier, c.Backend)
	}
	return ae.Encode()
}

// adoptConfig is the content of the NBD_CMD_RECONFIGURE that hands a
// device whose server died new sockets (nbd_genl_reconfigure: each socket
// replaces one the kernel marked dead, nbd_reconnect_socket; one more
// than there are dead sockets is dropped without an error). The backend
// identifier must be the device's (else EINVAL: "backend image doesn't
// match"); the timeouts are set again, as this server asks; SizeBytes (0:
// unchanged) grows the device in the same call.
type adoptConfig struct {
	Index           int
	Backend         string
	SizeBytes       uint64
	Timeout         time.Duration // whole seconds on the wire
	DeadConnTimeout time.Duration // whole seconds on the wire
	FDs             []int
}

// encodeAdopt builds the attributes of that NBD_CMD_RECONFIGURE.
func encodeAdopt(c adoptConfig) ([]byte, error) {
	if c.Index < 0 || c.Index > math.MaxInt32 {
		return nil, fmt.Errorf("device index %d out of range", c.Index)
	}
	if len(c.FDs) == 0 {
		return nil, errors.New("no socket to hand to the kernel")
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(nbdAttrIndex, uint32(c.Index))
	if c.SizeBytes != 0 {
		ae.Uint64(nbdAttrSizeBytes, c.SizeBytes)
	}
	ae.Uint64(nbdAttrTimeout, seconds(c.Timeout))
	ae.Uint64(nbdAttrDeadConnTimeout, seconds(c.DeadConnTimeout))
	if c.Backend != "" {
		ae.String(nbdAttrBackendIdentifier, c.Backend)
	}
	encodeSockets(ae, c.FDs)
	return ae.Encode()
}

// encodeSockets adds NBD_ATTR_SOCKETS with the descriptors fds.
func encodeSockets(ae *netlink.AttributeEncoder, fds []int) {
	ae.Nested(nbdAttrSockets, func(nae *netlink.AttributeEncoder) error {
		for _, fd := range fds {
			if fd < 0 || fd > math.MaxInt32 {
				return fmt.Errorf("bad socket descriptor %d", fd)
			}
			nae.Nested(nbdSockItem, func(s *netlink.AttributeEncoder) error {
				s.Uint32(nbdSockFD, uint32(fd))
				return nil
			})
		}
		return nil
	})
}
