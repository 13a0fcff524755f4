// Package nbd is the NBD server of rblk-attach: it serves a remote volume
// (a Backend) to NBD clients (qemu, libnbd tools, nbdfuse, fio, and the
// kernel's /dev/nbdX through ServeTransmission).
//
// # Protocol support
//
// Handshake: fixed newstyle only (no oldstyle, no TLS). The server sends
// NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES; client flags other than
// NBD_FLAG_C_FIXED_NEWSTYLE and NBD_FLAG_C_NO_ZEROES close the connection.
// Options:
//
//   - NBD_OPT_EXPORT_NAME: size and transmission flags (124 zero bytes
//     unless the client set NO_ZEROES); an unknown name closes the
//     connection, the only refusal this option has.
//   - NBD_OPT_GO, NBD_OPT_INFO: NBD_INFO_EXPORT; NBD_INFO_NAME and
//     NBD_INFO_DESCRIPTION when asked for; NBD_INFO_BLOCK_SIZE always
//     (MinBlock, PrefBlock, MaxBlock). Unknown export: NBD_REP_ERR_UNKNOWN,
//     malformed data: NBD_REP_ERR_INVALID, and the client may try again.
//   - NBD_OPT_LIST: one NBD_REP_SERVER per export, with its description.
//   - NBD_OPT_ABORT: NBD_REP_ACK, then the connection is closed.
//   - anything else, including NBD_OPT_STRUCTURED_REPLY (this server sends
//     simple replies only), NBD_OPT_STARTTLS and the meta context and
//     extended header options: NBD_REP_ERR_UNSUP.
//
// The name "" selects the first export of Options.Exports, unless an export
// is really named "".
//
// Transmission: simple replies; commands NBD_CMD_READ, WRITE, DISC, FLUSH,
// TRIM, WRITE_ZEROES (flags NBD_CMD_FLAG_FUA and NBD_CMD_FLAG_NO_HOLE);
// transmission flags HAS_FLAGS, READ_ONLY, SEND_FLUSH, SEND_FUA, SEND_TRIM,
// SEND_WRITE_ZEROES and CAN_MULTI_CONN after the Export's fields (TRIM and
// WRITE_ZEROES are not offered on a read-only export). Refusals, each with
// its own error reply on a connection that stays up:
//
//   - EPERM: WRITE, TRIM or WRITE_ZEROES on a read-only export;
//   - EINVAL: READ or TRIM beyond the end, READ or WRITE over MaxBlock, a
//     command or flag that was not offered (FLUSH without CanFlush, FUA
//     without CanFUA, …), an unknown command;
//   - ENOSPC: WRITE or WRITE_ZEROES beyond the end.
//
// The payload of a refused WRITE is read and dropped, so that the stream stays
// in sync, unless its length is over the hard limit of 32 MiB: that closes
// the connection, as does a bad request magic. Backend errors become the
// errno they wrap (errors.As to syscall.Errno) when NBD defines it (EPERM,
// EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW, ENOTSUP, ESHUTDOWN), ESHUTDOWN when
// the context ended, EIO otherwise (ENOMEM for a failed Alloc).
//
// # Concurrency
//
// Per connection, one goroutine reads request headers (and WRITE payloads,
// straight into the Backend's Buffer) and hands each request to a worker
// goroutine; up to Options.MaxInFlight workers are started as needed and
// then live as long as the connection, so a request costs no goroutine start
// and no allocation (request state is pooled). When all are busy the reader
// waits: the client's requests back up in the socket. Replies leave in
// completion order, each as one writev (header and data) under a mutex, or,
// for requests a blockdev.Submitter ends together (CompleteBatched), all
// of them in one writev when the backend flushes the batch; a
// READ's header is sent only after ReadAt returned, with its error if it
// failed. FLUSH is answered after Backend.Flush returned. On NBD_CMD_DISC, on
// a client that just closes its socket, on Close and when the ctx ends, the
// reader stops, the requests already read run to completion (their replies
// are sent if the socket still takes them), and only then is the connection
// closed and ServeConn returns. Connections of a multi-conn export are
// independent; they share the Backend. On a *net.TCPConn or *net.UnixConn
// (a kernel NBD device's socketpair among them) the reader's reads and the
// inline reply writevs are raw system calls (internal/rawsock), which do not
// wake the runtime's monitor thread whenever the idle process gets a
// request.
//
// # What comes from go-nbd
//
// github.com/pojntfx/go-nbd v0.3.2 is not the server: it serves one request
// at a time per connection, sends a READ's reply header before calling the
// backend (so a read error cannot be reported: the client was told success
// and the connection just drops),
// handles only READ, WRITE and DISC and advertises none of FLUSH, FUA, TRIM,
// WRITE_ZEROES or READ_ONLY (so fsync above it flushes nothing); it also
// copies every payload through its own buffer and reflects with binary.Read
// and binary.Write on every request. What is used of it is the constants of
// its pkg/protocol, for the wire values it defines correctly (magics, the
// options, replies and information types it knows, HAS_FLAGS,
// CAN_MULTI_CONN, READ/WRITE/DISC, EPERM, EINVAL): see proto.go, where the
// values it lacks (NO_ZEROES, client flags, NBD_OPT_EXPORT_NAME,
// NBD_REP_ERR_INVALID, the other transmission flags and commands, command
// flags, the other errnos) are defined, and proto_test.go, which pins every
// value to the specification. Its struct types are not used: they exist for
// binary.Read/Write; messages here are encoded in fixed arrays with
// binary.BigEndian.
//
// # The Backend's duties
//
//   - Every method is called concurrently (up to MaxInFlight per
//     connection, times the connections).
//   - Alloc lends exactly n bytes (the Segs add up to n; a buffer of another
//     size is returned with Free and the request fails with EIO) and may
//     wait for its pool, but it must not depend on another Alloc to make
//     progress: the buffers it waits for are held by requests in ReadAt or
//     WriteAt or in their replies, which end on their own. It must be able
//     to lend MaxBlock bytes at once. A buffer
//     belongs to the server from Alloc to Free and the backend must not use
//     it outside the calls it is passed to.
//   - A client that stops reading its socket holds the buffers of the READ
//     replies it does not take (bounded by MaxInFlight; on shutdown by a
//     30-second write deadline): size the pool for the connections served.
//   - WriteAt with fua, Trim with fua and WriteZeroes with fua return once
//     the data is durable; Flush returns once every write that returned
//     before Flush was called is durable. With MultiConn, that must hold
//     across connections: a Flush on one connection covers the writes
//     completed on all of them. Disconnection does not flush.
//   - WriteZeroes must make the range read as zeroes (noHole: keep it
//     allocated); Trim may do nothing.
//   - Errors should wrap a syscall.Errno to choose the client's error.
//   - The ctx given to ServeConn (or Serve) is the ctx of the backend calls;
//     when it ends they should return promptly.
//
// For the kernel path (ServeTransmission) there is no handshake, so the
// kernel learns neither MaxBlock nor the flags from this package: the caller
// configures the device (size, flags, block size) with the nbd ioctls or
// netlink, and either keeps MaxBlock at 32 MiB or limits the queue's
// max_sectors_kb, since the kernel sends requests up to its own limit.
package nbd
