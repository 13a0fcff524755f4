// Package attachstate is the registry of the rblk-attach processes running
// on this host: each keeps one small JSON file, DIR/PID.json (DIR is
// DefaultDir, /run/rblk/attach, unless configured), with its device or NBD
// socket, export, target, transport, state and reconnects. rblk-attach
// status lists them, and rblk-attach udev-id reads them to name
// /dev/ublkbN under /dev/disk/by-rblk/.
//
// A file is written atomically (a temporary file renamed over it) on each
// change of state, and removed when the process exits. The file of a
// process that died without removing it is stale: List skips it and
// removes it. A process is recognised by its pid and its start time (from
// /proc/PID/stat), so a pid used again by another process is no match.
package attachstate
