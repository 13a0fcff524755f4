// Package manage is rblkd's management of the volumes of its storage
// pools: create, delete, expand, list, capacity, publish and unpublish,
// each a transaction over a pool (package pool: the volume's files and
// record) and the target (the volume served as a Private export named
// POOL:VOLUME). rblkd's admin socket and its remote management API serve
// the same Service.
//
// The order of each operation is what makes a crash or a failure safe:
//   - Create writes the volume (record last), then serves it; a volume
//     that cannot be served is deleted again.
//   - Delete stops serving the volume (drained, written back), then
//     deletes its record and file.
//   - Publish records the host, then lets it open the volume.
//   - Unpublish records the host's removal, then fences it (its sessions
//     closed and their keys dead before Unpublish returns): after a
//     restart the record, not the reply, is what is served, and a reply
//     says only what is true on disk.
//
// Errors wrap the pool's sentinels (pool.ErrInvalid, pool.ErrNotFound,
// pool.ErrExists, pool.ErrNoSpace) or ErrNoPool; Code maps them to the
// status a remote caller gets.
//
// The caller's duties: New before the target serves; the target's export
// names with a ':' that a pool owns (Owns) are the Service's, never the
// configuration file's.
package manage
