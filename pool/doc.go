// Package pool keeps rblkd's storage pools: directories in which volumes
// are created by name and size, grown, published to hosts and deleted,
// each a sparse file the pool owns.
//
// A volume NAME is two files in the pool's directory: NAME.img, its data,
// and NAME.meta, its record (JSON: the data file's inode, whether it is
// shared, the hosts it is published to). The record is the commit: a
// volume exists once its record is in place (written beside it, synced,
// renamed over, the directory synced), and is gone once its record is
// removed. A create makes the data file as .NAME.img.new, writes the
// record, then renames the data file into place; a delete renames the
// data file to .NAME.img.new's twin .NAME.img.del, removes the record,
// then the file. Open finishes what a crash cut short (a create whose
// record is written goes in place; a delete that began is done) and
// removes what never committed. A NAME.img without a record is not the
// pool's (a file put there by hand): it is left alone and its name cannot
// be created. The record names the data file's inode: a data file
// replaced behind the pool's back is refused, not served.
//
// The caller's duties: a Pool does no IO on volumes' data and knows
// nothing of sessions. Before Delete, the caller stops serving the volume
// (drained, written back); before it publishes or unpublishes a host to
// the target, it records the change with SetHosts, so that a restart
// serves what was last answered. A Pool serializes its own operations;
// one process holds a pool's directory at a time (Open takes a lock file
// in it, ErrInUse for a second).
package pool
