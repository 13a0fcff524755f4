// Package mirror keeps a volume in two copies on two targets: an md RAID1
// (Linux's software RAID, managed with mdadm) over two rblk devices, with
// an internal write-intent bitmap, so that a member that comes back
// resyncs only what changed while it was away.
//
// rblk-attach makes each copy a block device; with --fast-fail-timeout
// its IO fails soon after its target goes away (md then fails the member
// instead of stalling the application) while it goes on reconnecting, and
// with --fail-on-lost-writes it fails for good when its target came back
// having lost acknowledged writes (md must then resync the member in full,
// never from its bitmap alone).
//
// The caller's duties: Up assembles the array over members that are
// attached (it creates it on fresh, zero-filled members); Supervise, run
// for as long as the array is up, re-adds a member that md failed once
// its device serves again (from the bitmap), and adds one that lost
// writes in full; Down stops the array before its members are detached.
// Every mdadm call goes through Options.Run, so tests drive the logic with
// a fake mdadm and a fake sysfs.
package mirror
