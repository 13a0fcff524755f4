// Package ublk serves a blockdev.Backend as a Linux ublk block device,
// /dev/ublkbN: the kernel's ublk_drv (Linux 6.0 and later, built with
// CONFIG_BLK_DEV_UBLK) queues the block layer's requests to this process
// through io_uring commands on /dev/ublkcN, one ring per hardware queue.
// It is the second front end next to initiator/nbd; the two share only the
// blockdev contract.
//
// How a request goes: every queue runs one goroutine locked to its OS
// thread (the kernel ties a queue's commands to the task that fetched
// them) with its own io_uring (package uring). A READ is started on that
// goroutine with the backend's Submitter, into a buffer the backend lends,
// and committed to the kernel when the backend completes it; a WRITE is
// given a buffer of the backend, filled with the request's data, and
// submitted. Where the kernel has UBLK_F_USER_COPY (6.5+) the goroutine
// moves the data itself, pwrite of a read's data to /dev/ublkcN before its
// commit, pread of a write's data; on older kernels (or with
// Options.NoUserCopy) the kernel copies a read's data from the buffer's
// address at the commit, and a write first comes back as "need data"
// (UBLK_F_NEED_GET_DATA) so the kernel copies its payload into the buffer
// lent then. Either way the data moves between the kernel's pages and the
// backend's (registered) memory with one copy and no allocation per
// request.
// The backend's completions reach the queue goroutine through a lock-free
// list and an eventfd that the ring reads. Flushes, discards, write-zeroes
// and requests whose buffer must be waited for run in a goroutine of their
// own.
//
// Requests are at most 256 KiB (MaxIO): the backend must lend a buffer of
// one contiguous segment for each (initiator.Volume does up to 256 KiB);
// a request it lends several segments for fails with EIO.
//
// The caller's duties: run as root (CAP_SYS_ADMIN) with ublk_drv loaded
// (Available tells, with one line saying what is missing); call Attach,
// then Detach once done — on SIGTERM, on the loss of the backend, or when
// Done is closed (the device was stopped by someone else, or a queue
// failed). Detach stops the device (the kernel ends what is still queued
// on it, new IO fails), waits for the requests the backend has, then
// deletes the device; the caller flushes and closes the backend after.
package ublk
