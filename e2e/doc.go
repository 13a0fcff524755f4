// Package e2e holds rblk's end-to-end tests. They build cmd/rblkd and
// cmd/rblk-attach once, run them as real processes, and drive the volume
// that rblk-attach serves with the clients Debian ships: qemu-io and
// qemu-img (qemu-utils), nbdinfo (libnbd-bin), fio, and nbdfuse with a loop
// device, mkfs.ext4, mount and e2fsck for a real file system. Faults come
// from outside the processes: kill -9, SIGTERM, SIGSTOP, a TCP fault proxy
// (internal/faultproxy), a slow disk under rblkd (nbdkit's delay filter),
// and greedy or malformed clients.
//
// Every test checks outcomes: the bytes of the backing file after the
// processes stop, checksums of files after a restart, the flags an NBD
// client sees, fio's verification, the metrics rblkd exports, and the exit
// status and message of the command-line tools. A panic, fatal error or
// data race in the output of any rblkd or rblk-attach fails its test,
// however the process ended.
//
// # One suite, every transport and device
//
// The same tests run over each transport and device (combo_test.go):
//
//	RBLK_E2E_TRANSPORT=tcp|rdma   the software provider (default) or the
//	                              verbs provider (build with -tags rdma)
//	RBLK_E2E_ADDR=IP              where rblkd listens: 127.0.0.1 by default;
//	                              over rdma the address of an RDMA device's
//	                              netdev (required; 192.0.2.1 in the guest)
//	RBLK_E2E_DEVICE=socket|nbd    rblk-attach --nbd-listen on a unix socket
//	                              driven by userspace NBD clients (default),
//	                              or --device auto: the kernel's /dev/nbdN
//	                              (root and the nbd module), driven through
//	                              the block device (fio with libaio, qemu-io
//	                              and mkfs on the device, the tests' NBD
//	                              client as system calls on it)
//
// This build machine has neither RDMA nor the nbd module: here the suite
// runs over tcp on the socket. The qemu guest of vm/ (Soft-RoCE on
// 192.0.2.1, the nbd module) runs it over rdma on both devices, with
// binaries built elsewhere, and its fault tests again in a soak under a
// CPU hog (scripts/vm-test.sh; vm/README.md):
//
//	go test -c -race -tags rdma,failpoints -o e2e.test ./e2e/
//	go build -race -tags rdma,failpoints -o bin/ ./cmd/rblkd ./cmd/rblk-attach
//	RBLK_E2E_TRANSPORT=rdma RBLK_E2E_ADDR=192.0.2.1 RBLK_E2E_DEVICE=nbd \
//	    RBLK_E2E_BIN_DIR=bin RBLK_E2E_REQUIRE=1 ./e2e.test -test.v
//
// A test that cannot run on a combination says why in its code: the TCP
// proxy cannot sit in an RDMA path (onlyTransport: its held-back bytes and
// late frames are tcp-only, its stall becomes rblkd stopped with SIGSTOP
// and its reset a silence past the keepalive: faultLink, silenceTarget;
// a half-open link, reset on the attach's side only, is the proxy's too),
// malformed frames and silent streams (before their connect request) of
// the software transport, the NBD server's flags that only a userspace
// client sees (needSocket). Such a test ends as NOT
// APPLICABLE with its reason (notApplicable), and TestMain lists them.
//
// For tests added here: start daemons with startTarget, startTargetOn and
// startAttach (they take the run's transport, address and device); give
// command lines you build yourself "--transport", e2eTransport(); point
// qemu-io, qemu-img and nbdfuse at attacher.uri, fio at fioTarget(uri), and
// the raw NBD client at dialNBD(t, attacher.sock, name): each works on both
// devices. Break a link with startFaultLink, not the proxy itself, unless
// the test is tcp-only (then say so with onlyTransport). A raw client of
// rblkd (link.Dial, rawAuth) takes clientProvider: over tcp it plays
// another host from another loopback address, over rdma it has rblkd's
// own address, as every process of rblkd's host does (localPeer).
//
// # Other settings
//
// A test whose tool is missing (or that needs root and /dev/fuse) skips
// with the reason, unless RBLK_E2E_REQUIRE=1 is set: then it fails, so
// that CI (scripts/test.sh sets it) can never pass by skipping; a NOT
// APPLICABLE is no skip of that kind. No test skips but through those two
// (skipOrFail, notApplicable): TestNoSilentSkip fails on a direct t.Skip
// anywhere in the suite's sources. RBLK_E2E_RACE=1 builds the binaries
// with the race detector; RBLK_E2E_TAGS adds build tags (rdma is added
// over rdma); RBLK_E2E_BIN_DIR=DIR uses DIR/rblkd and DIR/rblk-attach as
// they are instead of building; RBLK_E2E_LOG_DIR=DIR keeps the output of
// every process a test starts in DIR/TEST/NAME-N.log, as it comes.
// RBLK_FAULT_SEED repeats a fault test's random choices.
//
// Run them with
//
//	go test -count=1 ./e2e/
//
// or, with the tools installed and every check required, scripts/test.sh.
package e2e
