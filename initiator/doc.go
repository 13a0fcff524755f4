// Package initiator is the client side of rblk: it opens a remote volume on
// a target and serves it as an NBD export (package initiator/nbd), so that
// qemu, fio, nbdfuse or the kernel's /dev/nbdX can use it as a block device.
//
// Data never passes through the target's CPU. The initiator keeps a table
// of grants: for each chunk of the volume it uses, the address, rkey, length
// and generation under which the target registered the chunk in its memory.
// A read is an RDMA READ from the chunk into a registered buffer; a write is
// an RDMA WRITE into the chunk followed by a Done message naming the range;
// FUA and flush wait for the target to make ranges durable; trim and
// write-zeroes are requests the target's CPU carries out. A write is
// acknowledged once its Done reached the target. At depth, writes share
// Dones: each queue keeps a few in flight (doneWindow), and the writes
// that find them all out post their WRITEs at once and are reported
// together by the next one.
//
// A chunk without a grant is asked for on first use. When the target needs
// the memory back it revokes the grant: new IO stops using it, IO in flight
// finishes (and sends its Done), then the initiator acknowledges, and later
// IO asks again.
//
// # Faults
//
// The link to the target is kept alive (a KeepAlive probe on a quiet link,
// Options.KeepAlive) and every request has a timeout (Options.IOTimeout,
// FlushTimeout); a silent or dead link goes down, and the volume reconnects
// for Options.ReconnectTimeout while IO waits, then redoes the IO that was
// in flight, or fails it with EIO. With a HostID, the target fences the
// earlier session before the new one does IO, so nothing of the old
// connection lands after it: the volume's reconnects carry its instance
// (Options.Instance), which tells the target it is the same attach coming
// back. Back on the same target process (VolumeInfo's Instance) nothing
// acknowledged is lost; on another (a crash and restart) the next Flush
// fails once with ErrLostWrites if writes were acknowledged since the last
// successful flush.
//
// Another attach of the same host ID and export (another Volume, another
// instance) is refused by the target while this one lives: Open fails with
// protocol.ErrBusy, whose text names this one. With Options.Takeover it
// fences this one instead; a volume fenced so, or found dead by the
// target's liveness check while it hung, stops with ErrFenced.
//
// # Usage
//
//	v, err := initiator.Open(ctx, initiator.Options{Provider: p, Target: addr, Export: "vol0", HostID: id})
//	// v is a blockdev.Backend (and Submitter): serve it with a front end,
//	// such as package nbd's server.
//	srv, err := nbd.NewServer(nbd.Options{Exports: []*nbd.Export{{Name: "vol0", Size: v.Size(), Backend: v, ...}}})
//	go srv.Serve(ctx, listener)
//	...
//	srv.Close()
//	v.Close(ctx) // flushes, then closes the session
//
// The caller must close the NBD server before the volume, and should watch
// Done: once the session with the target is down every IO fails.
package initiator
