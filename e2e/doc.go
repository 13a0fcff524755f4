// Package e2e holds rblk's end-to-end tests. They build cmd/rblkd and
// cmd/rblk-attach once, run them as real processes on 127.0.0.1 (transport
// tcp, the software provider), and drive the NBD export that rblk-attach
// serves with the userspace NBD clients Debian ships: qemu-io and qemu-img
// (qemu-utils), nbdinfo (libnbd-bin), fio's nbd engine, and nbdfuse with a
// loop device, mkfs.ext4, mount and e2fsck for a real file system.
//
// Every test checks outcomes: the bytes of the backing file after the
// processes stop, checksums of files after a restart, the flags an NBD
// client sees, fio's verification, the metrics rblkd exports, and the exit
// status and message of the command-line tools.
//
// A test whose tool is missing (or that needs root and /dev/fuse) skips
// with the reason, unless RBLK_E2E_REQUIRE=1 is set: then it fails, so
// that CI (scripts/test.sh sets it) can never pass by skipping. Setting
// RBLK_E2E_RACE=1 builds the binaries with the race detector.
//
// Run them with
//
//	go test -count=1 ./e2e/
//
// or, with the tools installed and every check required, scripts/test.sh.
package e2e
