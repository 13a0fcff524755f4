// Package target is the storage side of rblk: it exports backing files and
// block devices as volumes, and serves them to initiators through a bounded
// cache of registered memory.
//
// The target's CPU does not move data over the network. An initiator asks,
// under a handle it opened, for a grant of the chunk that holds an offset;
// the target loads the chunk into a slot of its cache (memory of its own,
// never a mapping of the backing file), registers the slot on that
// initiator's connection (remote read, and remote write when that handle is
// open for writing) and replies with the address, rkey, length and
// generation. From then on the initiator reads and writes the chunk with
// one-sided RDMA READ and WRITE and tells the target, with a Done message
// under the same handle, which ranges it wrote.
//
// A grant belongs to the handle it was made for: it carries that handle's
// access (a read-only handle never holds a writable key, whatever else its
// session holds), two handles of one session asking for one chunk get two
// grants, and a Done is accepted only for ranges the handle's own grants
// cover.
//
// The target's work is what only it can do:
//
//   - admit: every session authenticates first (Options.Auth: a mutual
//     challenge-response, see package auth; without it the host names
//     itself), once per connection, within Options.HandshakeTimeout of
//     its accept and the session limits, which count it only once proven;
//     connections waiting to authenticate are bounded apart
//     (MaxUnauthenticated, fairly by address), failed authentications
//     are limited by address and host ID (FailedAuthPerPeer,
//     FailedAuthPerHost), a session's handles by MaxHandlesPerSession,
//     and the log lines a client can repeat by LogLimit;
//     an export may allow only some hosts (ExportConfig.Allow), and has one
//     writing host at a time unless Shared: another host's read-write Open
//     fails with ErrBusy naming the holder, or, with OpenTakeover, fences
//     the holder first;
//   - load chunks on demand, and evict the least recently granted one when
//     the cache is full: it first revokes every grant of the chunk (a Revoke
//     under the grant's handle; the initiator acknowledges once it no longer
//     uses it, after its last Done), deregisters the regions, writes dirty
//     blocks back, then reuses the slot. Which chunk is where, who holds a
//     grant of it and what to evict is decided by a state machine without
//     IO (chunkTable, chunktable.go); the cache does the IO it asks for;
//   - write back the dirty ranges named by Done messages, asynchronously and
//     coalesced: in file order, neighbouring ranges of a chunk merged into
//     one write, ranges of chunks adjacent in the file into one vectored
//     write (see writeback.go);
//   - Flush: reply only after every range of an earlier Done is written back
//     and the file fdatasync'd, reporting any write-back error since the last
//     flush;
//   - Trim and WriteZeroes: zero the cached copy and the file (fallocate);
//   - refuse what is malformed or out of range with an Error message, and
//     close a session that breaks the protocol, without touching the others;
//   - fence: a read-write Open with a host ID first fences the earlier
//     session of that host ID and export (grants deregistered, handle stale,
//     connection closed, requests finished) when it is the same attach
//     coming back (the same instance, or an Open without one); another
//     attach of the host fails with ErrBusy naming the live holder, unless
//     it takes over (OpenTakeover), or the holder's link is down, or it
//     does not answer a KeepAlive within Options.LivenessProbe (one such
//     probe at a time per host and export); Done and Flush name the
//     session's generation. A grant dies with its revoke, its own handle's
//     Close (not another's), and its session's end or fence: its rkey then
//     reaches nothing. A session's identity as an export's writer lasts
//     while it has a read-write handle of it open;
//   - share the cache fairly: the sessions of one host ID (a session's
//     queues among them; an anonymous session alone) are one share, and the
//     cache is split equally between the hosts with a handle open. A host
//     at or over its share gives up its own chunks when it needs another;
//   - keep sessions honest: a silent initiator is dropped (KeepAlive); every
//     holder of a grant has the whole revoke timeout to answer a revoke,
//     whatever share it holds (a healthy initiator on a loaded machine may
//     be slow), and one that does not answer in that time is dropped and
//     its host's share cut to a quarter for three revoke timeouts; a grant
//     waiting for a slot never waits on one slow holder for long: after a
//     twentieth of the revoke timeout (at most 250 ms) it starts another
//     eviction, and evictions prefer chunks whose holders have no revoke
//     outstanding for that long. A host that holds the whole cache and
//     never answers delays the others by one revoke timeout, once;
//   - when a handle closes or a session ends without a clean close (a lost
//     link, a fence, an unanswered revoke), write back whole chunks it held
//     writable, since its last Dones may be lost while its RDMA WRITEs are
//     in the cache;
//   - grow a volume online (Grow): extend the backing file (a block device
//     must be large enough already), make the new size the one every check
//     uses, revoke a short last chunk so that it is granted again whole,
//     then tell every connection with the volume open (a Resize notice);
//   - change exports while serving (exports.go): AddExport (or
//     PrepareExport, which opens and checks the file without changing
//     anything, then AddPrepared), RemoveExport (drains the export's
//     sessions as Close drains them all, writes its chunks back, syncs and
//     closes its file), UpdateExport (allow, shared, a larger size, another
//     name of the same file), Exports; the sessions of other exports are
//     never touched. These run one at a time and yield to Close, which
//     ends the waits of the one in progress (a drain) at once;
//   - open backing files without ever blocking (package safeopen): a FIFO,
//     a socket, a character device or a directory is refused at once;
//     each file is one export, told by its device and inode (a block
//     device by its device number), whatever name reaches it: a second
//     export of it is refused with ErrSameFile, naming the first.
//
// # Usage
//
//	t, err := target.New(target.Options{Exports: exports, Logger: log, Registerer: reg})
//	l, err := provider.Listen(ctx, addr)
//	go t.Serve(ctx, l)
//	...
//	t.Close() // drains the initiators, ends sessions, writes back and syncs everything
//
// The caller owns the listener's provider and must Close the target: dirty
// chunks live only in the cache until they are written back.
package target
