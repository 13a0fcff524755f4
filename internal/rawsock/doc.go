// Package rawsock reads and writes non-blocking sockets with raw system
// calls: syscall.RawSyscall, not syscall.Syscall, inside
// syscall.RawConn's Read and Write.
//
// Why: a read(2) or writev(2) on a non-blocking socket never sleeps, but
// through syscall.Syscall it is entered as a system call that may, and
// that wakes the runtime's monitor thread (sysmon) out of its deep sleep
// whenever the process was idle. An IO path at queue depth 1 goes idle
// between requests, so each request paid for that wake-up, and for the
// monitor's short sleeps after it: on a 2-core machine, fio's nbd engine
// at QD1 through rblk-attach and rblkd over loopback, the monitor made
// 2.5 nanosleeps per request, as many as the IO path's own waits in
// epoll. With raw calls the monitor sleeps until something else needs it.
//
// Raw calls hold the goroutine's P for their length, which is what a
// non-blocking read or write of a socket takes anyway: a copy of at most
// the caller's buffer. The callers keep their buffers bounded (64 KiB
// reads, bounded batches of writes).
package rawsock
