// Package kernel attaches an NBD export of this process to the kernel as a
// block device, /dev/nbdN, through the kernel's NBD driver and its generic
// netlink interface (Linux only, no cgo).
//
// # Attach
//
// Attach makes Options.Connections socketpairs (AF_UNIX, SOCK_STREAM;
// default: the number of CPUs, capped at 4), serves this process's end of
// each with nbd.Server.ServeTransmission (no handshake: the kernel is told
// everything by netlink), and sends one NBD_CMD_CONNECT (family "nbd",
// version 1) with:
//
//   - NBD_ATTR_INDEX (u32): N of /dev/nbdN, left out for "auto": the kernel
//     then takes the first device that has no configuration (creating one if
//     all are taken) and names it in its reply, NBD_ATTR_INDEX again. This
//     is in the kernel since NBD_CMD_CONNECT exists (4.12), so Debian 12's
//     6.1 has it: no scan of /sys/block/nbd*/pid is needed.
//   - NBD_ATTR_SIZE_BYTES and NBD_ATTR_BLOCK_SIZE_BYTES (u64): the export's
//     size; 4096-byte blocks (lowered to 2048, 1024 or 512 when the size is
//     no multiple of 4096).
//   - NBD_ATTR_SERVER_FLAGS (u64): the transmission flags package nbd would
//     advertise in its handshake (ServerFlags): HAS_FLAGS, SEND_FLUSH,
//     SEND_FUA, SEND_TRIM, SEND_WRITE_ZEROES, CAN_MULTI_CONN, READ_ONLY for
//     read-only volumes. With SEND_FLUSH the kernel shows the queue as
//     "write back" and sends a FLUSH for every fsync; with SEND_FUA it sends
//     FUA writes; with SEND_TRIM discard (fstrim, mount -o discard) reaches
//     the volume. 6.1 ignores SEND_WRITE_ZEROES (its driver has no
//     WRITE_ZEROES); later kernels use it.
//   - NBD_ATTR_TIMEOUT (u64, seconds): DefaultTimeout, 3 minutes; see there
//     for why.
//   - NBD_ATTR_DEAD_CONN_TIMEOUT (u64, seconds): 0. The kernel waits that
//     long for a new socket (NBD_CMD_RECONFIGURE) when all of a device's
//     sockets are dead; this package never sends one, so waiting would only
//     delay the errors.
//   - NBD_ATTR_BACKEND_IDENTIFIER (string): "rblk" or Options.Backend, shown
//     in /sys/block/nbdN/backend.
//   - NBD_ATTR_SOCKETS: one nested NBD_SOCK_ITEM per socket, each holding
//     NBD_SOCK_FD (u32), the kernel's end. The kernel takes its own
//     reference to each during the call; ours are closed after it.
//
// Attach then waits (up to 5 s) until the kernel reads every socket: it
// reads each in a work item of the device's workqueue "nbdN-recv", and
// counts the workers running one (/proc/PID/comm ends in "+nbdN-recv").
// When the kernel is slow to start workers for them (a loaded machine; under
// emulation, the first attach after boot), the workqueue's rescuer thread
// may take all of them and run only the first: the others wait behind it
// until that socket ends, and the requests sent on their sockets wait for
// the request timeout. Kernels without commit e5a30c303b07 ("workqueue:
// Process rescuer work items one-by-one using a cursor"), such as Debian
// 12's 6.1, do that. Attach then detaches the device and attaches it again
// (three attempts in all; after them it logs a warning and returns the
// device, which works on the sockets the kernel reads).
//
// The kernel answers EBUSY for a device that has a configuration already
// (ErrInUse), EPERM without CAP_SYS_ADMIN, and ENOENT for the family when
// the nbd module is not loaded: ErrNoModule, "the kernel has no nbd module:
// run `modprobe nbd`".
//
// # Detach
//
// Device.Detach sends NBD_CMD_DISCONNECT (NBD_ATTR_INDEX only). What the
// kernel does then (drivers/block/nbd.c, nbd_disconnect_and_put): it sends
// NBD_CMD_DISC on every socket, shuts the sockets down, waits for its
// receive workers and fails the requests still waiting for a reply with EIO.
// It does not drain: whatever is in flight at that moment fails for the
// kernel's user. Unmount first; umount (like fsync) has the file system
// write its data and send a FLUSH, so after it nothing is in flight. On our
// side each connection stops reading at NBD_CMD_DISC (or at the end of the
// stream), lets the requests it already read finish in the backend (so
// their writes are done even if the kernel no longer waits for the reply),
// and ends; Detach waits for all of them, then calls Backend.Flush for a
// writable export. So every write that reached this process is durable when
// Detach returns nil, whoever disconnected.
//
// Detach (the function) disconnects a device by path, whatever process
// serves it; that is `rblk-attach detach`. The serving rblk-attach sees its
// connections end (Device.Done), calls Device.Detach, which skips the
// NBD_CMD_DISCONNECT that already happened (it could hit a device attached
// anew meanwhile), waits, flushes, and exits.
//
// If this process dies without detaching, the kernel sees its sockets close:
// IO on the device fails, and the device stays configured (its pid file
// names the dead process) until `rblk-attach detach` disconnects it.
//
// # No go-nbd client
//
// github.com/pojntfx/go-nbd's client (v0.3.2) is not used, not even as a
// fallback for kernels without the netlink interface (all kernels since
// 4.12 have it). It configures the device with the old ioctls and cannot set
// the server flags, so the kernel would never send FLUSH, FUA or TRIM: fsync
// on a file system above it would make nothing durable. It also fails with
// EINVAL for several sockets, and cannot hand over a new socket.
//
// # Limits
//
// The kernel sends requests of up to 32 MiB (its max_hw_sectors), so the
// export's MaxBlock must stay at 32 MiB. A dead socket is not replaced
// (no NBD_CMD_RECONFIGURE): with several connections the kernel moves the
// IO of a dead one to the others.
package kernel
