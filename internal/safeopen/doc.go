// Package safeopen opens the files rblkd and rblk-attach are told to use
// (backing files of exports, the auth file, secret files, the host ID
// file, the configuration file) without ever blocking on one that is not
// what it should be.
//
// open(2) of a FIFO blocks until its other end opens, an open of a
// terminal may make it the controlling one, and a device's open may wait
// for hardware. Every open here is O_NONBLOCK|O_NOCTTY|O_CLOEXEC, the
// kind of the file is checked with fstat(2) on the descriptor opened (not
// on the name, which may change between a stat and an open), and anything
// but the kinds asked for is refused at once with an error naming the
// path and its kind:
//
//	/srv/rblk/vol0.img is a FIFO: want a regular file or a block device
//
// The name is stat'ed first too, so that a device of the wrong kind is
// refused without being opened at all (an open of some devices has side
// effects). O_NONBLOCK is cleared again before the file is returned, for
// ordinary blocking IO. Symbolic links are followed: a link to a file is
// legitimate, and what the open reached is what fstat describes. Callers
// that must recognize one file under several names compare the ID of what
// they opened (IDOf).
package safeopen
