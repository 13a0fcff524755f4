// Package uring is a small io_uring binding, enough for the ublk front end:
// a ring of 64- or 128-byte submission entries (IORING_SETUP_SQE128, which
// ublk's control commands need), mapped once, filled by one goroutine, and
// entered with io_uring_enter. It makes no allocation per entry.
//
// A Ring is not safe for concurrent use: one goroutine prepares entries,
// submits and reaps completions. Kernel drivers that tie a ring's commands
// to the submitting task (ublk does, per queue) need that goroutine locked
// to its OS thread (runtime.LockOSThread), which is the caller's duty.
//
// Memory whose address goes into an entry (a read's buffer, a command's
// data) must stay put until its completion: not on a goroutine stack, which
// moves when it grows or shrinks; heap or mmap'd memory is fine.
//
// Linux only (5.1 and later for the basic ring, 5.19 for IORING_OP_URING_CMD
// and SQE128); elsewhere New fails with ErrUnsupported.
package uring
