// Package protocol defines the control messages that the rblk target and
// initiator exchange, and their wire format.
//
// # Roles
//
// The target (rblkd) exports volumes: files or block devices it serves. It
// keeps chunks of a volume in memory registered with the connection, and lends
// them to the initiator as grants: (address, rkey, length, generation) for one
// chunk. The initiator (rblk-attach) attaches an export as a local block device.
// It moves the data itself with one-sided RDMA READ and RDMA WRITE into granted
// chunks, without the target's CPU, and uses the messages of this package,
// carried by two-sided SEND/RECV, for everything else. The target writes back
// what the initiator wrote (the initiator tells it what with Done), evicts
// chunks by revoking their grants, and does Trim and WriteZeroes itself with
// fallocate.
//
// # Message flow
//
// A typical connection, one arrow per message (=== is a one-sided operation
// that the target's CPU does not see):
//
//	initiator                                               target
//	 connect, private data Hello  ------------------------->
//	                              <-------------------------  accept, private data Hello
//	 AuthStart{"host-a", Ci}      ------------------------->
//	                              <-------------------------  AuthChallenge{"tgt", Ct, required}
//	 AuthResponse{Pi}             ------------------------->  checks Pi
//	                              <-------------------------  AuthAccept{Pt}
//	 ListExports                  ------------------------->
//	                              <-------------------------  ExportList
//	 Open{read-write, "vol0",     ------------------------->  fences the earlier session
//	      host "host-a",                                      of this attach of "host-a"
//	      instance 0x5eed}                                    on "vol0"
//	                              <-------------------------  VolumeInfo{handle 1, session gen 3}
//	 GrantRequest{1, write, off}  ------------------------->
//	                              <-------------------------  Grant{1, write, chunk, addr, rkey, gen 7}
//	 RDMA READ / RDMA WRITE       =========================>
//	 Done{1, session gen 3,       ------------------------->
//	      [(off, len)]}
//	 Flush{1, session gen 3}      ------------------------->
//	                              <-------------------------  OK
//	                              <-------------------------  KeepAlive (link quiet)
//	 OK                           ------------------------->
//	                              <-------------------------  Revoke{1, chunk, gen 7}
//	 RevokeAck{1, chunk, gen 7}   ------------------------->
//	 Close{1}                     ------------------------->
//	                              <-------------------------  OK
//
// Step by step:
//
//   - Hello goes in the connection's private data, both ways: the initiator's
//     with its connect request, the target's with its accept. Each side then
//     calls Negotiate with its own Hello and the peer's, and uses only the
//     features both offered (FeatureOpenInstance). Hello is always framed
//     as version 1 with credits and tag 0, and must fit the 56 bytes of private
//     data (it takes 40).
//   - AuthStart is the first request of every session; the target refuses
//     anything else before the exchange ends (an Error with CodeAccess,
//     then it closes the connection). It names the host and brings the
//     initiator's challenge; AuthChallenge brings the target's, and says
//     whether the target authenticates (AuthRequired). If it does, the
//     initiator answers with its proof (AuthResponse) and checks the
//     target's (AuthAccept); package auth computes and checks the proofs.
//     A target without keys ends the exchange at AuthChallenge.
//   - ListExports returns every export, its size and flags, in one ExportList.
//   - Open opens an export read-only or read-write (an export may allow only
//     some hosts: CodeAccess; a read-write export has one writing host at a
//     time unless shared: CodeBusy, or with OpenTakeover the holder is
//     fenced first); VolumeInfo gives the handle
//     that names it in the connection's later requests, its size, its logical
//     block size, its chunk size and the session's generation.
//   - Sessions are reinstated by host ID and instance, as iSCSI's by
//     initiator name and session ID (ISID). Open carries the initiator's
//     stable host ID (empty for an anonymous initiator, whose sessions are
//     never reinstated nor fenced) and, with OpenInstance, its instance: a
//     random number, never 0, that names one attach (one initiator
//     process) and stays the same on its reconnects and its queues. A
//     read-write Open with a host ID is the same attach coming back when
//     its instance is the one of the current session of that host ID and
//     export, or when it has no instance (an initiator of before
//     instances, or a target that did not offer FeatureOpenInstance: such
//     Opens are reinstated as before instances existed). The same attach
//     coming back fences the earlier session before the target replies:
//     its grants are revoked and deregistered, its connection closed, and
//     nothing still in flight on it can reach the cache.
//   - Another attach of the same host ID (another instance; also an Open
//     with an instance when the current session has none) does not fence a
//     live session. The target checks that the current session lives: if
//     its link is down it is fenced as above; otherwise the target sends
//     it a KeepAlive and waits a short bound (a few seconds, at most its
//     keepalive timeout). A session that does not answer in time is dead
//     (its host crashed, or hangs): it is fenced, and the Open goes on.
//     One that answers keeps the export, and the Open is refused with
//     CodeBusy and a text that names it: its session, instance, peer
//     address and since when it holds the export, and how to take it over
//     anyway (OpenTakeover: rblk-attach --takeover). One such probe runs
//     at a time per host ID and export (Opens meanwhile wait for its
//     answer), an answer counts for a second, and a refused Open leaves
//     nothing behind on the target. With OpenTakeover the live session is
//     fenced without a probe.
//   - VolumeInfo's Generation is never 0 and unique within the target's
//     lifetime; a reconnecting initiator of the same host ID and export
//     gets a higher one than its earlier sessions. Done and Flush carry the
//     session's generation and a stale one is refused with CodeStale.
//     Read-only Opens carry the instance too, but they neither fence nor
//     are fenced.
//   - Join adds another connection to an open session, as one more IO
//     queue: after its own AuthStart (as the same host), the connection
//     sends Join with the export, the host ID and the session's generation,
//     and VolumeInfo gives it a handle of its own and the same generation.
//     Grants, Done, Flush and Revoke are per connection, as on the first
//     one; the generation, and fencing, are the session's: a later Open
//     that fences the session (its attach coming back, a takeover, or
//     another attach that found it dead) fences every connection of it,
//     and a Join of a generation that is not the host's current one is
//     refused with CodeStale. A Join carries no instance: the generation
//     names the session. Anonymous sessions have no queues. An initiator that needs
//     every write it completed durable sends Flush on every connection of
//     the session (a Done on one connection is not ordered with a Flush on
//     another).
//   - GrantRequest asks, on demand, for the chunk that holds an offset; Grant
//     gives the chunk's start, its registered memory (Addr, RKey, Length) and
//     a Generation that tells this grant from earlier and later ones of the
//     same chunk. Volume byte Grant.Offset+i is at remote address Addr+i. With
//     GrantWrite the region is writable; without, only RDMA READ may use it.
//     The initiator keeps the grants it got and reuses them until revoked.
//   - A grant belongs to the handle it was asked under, and has that
//     handle's access: a read-only handle's grant is never writable, even
//     if the connection holds a writable grant of the same chunk under
//     another handle; two handles of one connection get two grants (two
//     rkeys) of a chunk if both ask. A grant lives until its Revoke, its
//     handle's Close or the end (or fencing) of its connection.
//   - To write, the initiator RDMA WRITEs into a writable grant and, once the
//     WRITE has completed, sends Done with the ranges it wrote. Done has no
//     reply unless it fails, or with DoneFUA the reply OK once its ranges are
//     durable. Ranges of one Done may span several chunks of the handle, and
//     must lie within writable grants of that handle (not of another one).
//   - Flush replies OK once every range of every Done the target received
//     before it, on this connection, is written back and fdatasync'd. It
//     carries the session's generation, as Done does.
//   - To evict a chunk the target sends Revoke (with a tag of its own), one
//     per grant of the chunk, naming the handle of that grant. The
//     initiator stops starting operations on that grant, waits for those in
//     flight, sends Done for what it wrote through it, then replies RevokeAck
//     with the Revoke's tag. The target may then deregister the memory and
//     reuse it; a later GrantRequest gets a new grant with a new generation.
//     The initiator answers every Revoke, even one for a grant it no longer
//     has. An initiator that does not answer within the target's revoke
//     timeout (the same for every initiator, rblkd --revoke-timeout) loses
//     its connection.
//   - Trim and WriteZeroes are done by the target's CPU with fallocate (punch
//     a hole, or zero a range; FlagNoHole keeps the range allocated). The
//     target applies them after the Dones received before them, and updates
//     or revokes the grants they cover; FlagFUA replies once durable.
//   - Close releases the handle and all its grants, and only those: the
//     initiator stops using them when it sends Close; the grants of the
//     connection's other handles stay. Close does not flush: send Flush
//     first if the data must be durable.
//   - KeepAlive checks a quiet link: either side sends it, with a tag of its
//     own, when it has received nothing from its peer for a while, and the
//     peer replies OK with that tag (never Error). A side that gets no
//     reply in time takes the connection for dead.
//   - When the target shuts down cleanly it first sends an Error with tag 0
//     and CodeShutdown, a notice rather than a reply. The initiator then
//     starts no new operation on the connection, lets those in flight finish
//     (and sends their Done), sends Flush, and disconnects once it has the OK:
//     every write it acknowledged is then durable. The target waits while
//     the initiators make progress (bounded) before it closes the
//     connection itself.
//   - When a read-write Open with a host ID fences an earlier session of the
//     same host ID and export, the target first deregisters that session's
//     grants and marks its handle stale, then sends it an Error with tag 0
//     and CodeStale, a notice, and closes its connection. An initiator that
//     receives the notice stops: it was replaced by another attach (one that
//     took the export over, or found it dead), and reconnecting would be
//     refused or fence that one in turn. (A session fenced because its own
//     initiator reconnected never sees the notice: its initiator has
//     already left that connection.) An initiator whose reconnect is refused
//     with CodeBusy was replaced the same way while its link was down.
//   - When a volume grows online (rblkd export grow), the target first makes
//     the new size its own (the backing file extended, every size check and
//     later VolumeInfo and ExportList with the new size; a cached last chunk
//     that was short is revoked, so that its grant is asked again with the
//     new length), then sends Resize, a notice with tag 0 and no reply, on
//     every connection that has the volume open (each queue of a session)
//     with the handle and the new size. The initiator may use the range up
//     to the new size from then on. A volume never shrinks: an initiator
//     ignores a Resize that is not larger than the size it knows, and a
//     reconnecting initiator takes a larger VolumeInfo size as a Resize.
//   - Any request may be answered by Error, with the request's tag, instead of
//     its reply; ErrorMsg.Err turns it into a *RemoteError, which errors.Is
//     matches with ErrStale, ErrPerm and the like. CodeStale means the grant
//     is unknown or revoked: ask for a new one; or, for Done and Flush, that
//     the session's generation is older than the target's current one for
//     that host ID and export: the session was fenced.
//
// A volume growing to 3 GiB while a session holds the grant of its short
// last chunk:
//
//	initiator                                               target
//	                              <-------------------------  Revoke{1, last chunk, gen 9}
//	 RevokeAck{1, last chunk, 9}  ------------------------->
//	                              <-------------------------  Resize{1, 3 GiB} (tag 0)
//	 GrantRequest{1, write, off}  ------------------------->  (off beyond the old size)
//	                              <-------------------------  Grant{1, write, chunk, ...}
//
// Requests, who sends them and their replies:
//
//	request        sent by     reply (or Error)
//	ListExports    initiator   ExportList
//	Open           initiator   VolumeInfo
//	Join           initiator   VolumeInfo
//	GrantRequest   initiator   Grant
//	Done           initiator   none, or OK with DoneFUA
//	Flush          initiator   OK
//	Trim           initiator   OK
//	WriteZeroes    initiator   OK
//	Close          initiator   OK
//	Revoke         target      RevokeAck (never Error)
//	KeepAlive      either      OK (never Error)
//	Credit         either      none (never Error)
//	Resize         target      none: a notice, tag 0 (never Error)
//
// A tag is chosen by the sender of a request and is not reused while a reply
// to it may still come (a Done without DoneFUA may still be answered by
// Error); a counter is simplest. Each side has its own tag space: a reply is
// matched with the requests its receiver sent. The replies are Error,
// ExportList, VolumeInfo, Grant, RevokeAck and OK; Resize (and Error with
// tag 0) are the target's notices; the other types but Hello are requests. An OK can thus come to either side: the initiator gets it
// for its requests, the target for its KeepAlives.
//
// # Flow control
//
// Every message is a SEND that consumes one receive buffer the peer posted; a
// SEND with no buffer waiting breaks the connection. So each side counts its
// credits: the receive buffers its peer has posted for it and it has not used
// yet. Hello.RecvCredits gives the initial credits; afterwards the header's
// credits field returns the buffers the sender re-posted since its previous
// message. The rules:
//
//   - A side sends only while it has a credit; each message uses one.
//   - It never spends its last credit on a message whose credits field is 0:
//     that credit is kept to return credits, so the two sides can never both
//     be stuck at zero.
//   - A side that owes its peer credits returns them in its next message. If
//     it has nothing to send, it sends Credit once it owes T of them, with
//     2 <= T <= N-1 for the N buffers it keeps posted for the peer (N/2 is a
//     good choice; so N >= 3). T >= 2 keeps a Credit from being answered by a
//     Credit; T <= N-1 guarantees that a peer holding only its reserved last
//     credit is always refilled.
//   - KeepAlive and its OK are ordinary messages: each uses a credit and
//     returns those owed, under the rules above. A side holding only its
//     reserved last credit, with none to return, cannot send KeepAlive; its
//     peer then owes it credits, and their not coming in time says as much
//     about the link as a missing OK.
//   - A side never sends a message larger than the peer's Hello.MaxMessage,
//     and posts receive buffers of at least its own MaxMessage bytes. Every
//     message of this version fits MaxMessageSize.
//
// # Invariants
//
//   - One-sided operations go only into granted chunks: within [Addr,
//     Addr+Length) of a grant the initiator holds, RDMA WRITE only with
//     GrantWrite, and none after the initiator sent the RevokeAck of that
//     grant or the Close of its handle. The target deregisters revoked
//     memory, so a stray operation breaks the connection.
//   - Done for a range is sent after the RDMA WRITE of that range has
//     completed, and before the RevokeAck of its chunk's grant. SENDs on one
//     connection arrive in order, so when the target gets the RevokeAck it has
//     every Done of that grant.
//   - Flush covers every Done received before it on that connection: their
//     ranges are durable when OK arrives. It says nothing of Dones sent after
//     it, or on other connections.
//   - Every request gets exactly one reply (its reply or Error), except Done
//     without DoneFUA, which gets one only if it fails, and Credit. Revoke
//     and KeepAlive are never answered by Error.
//   - Once the target has replied to a read-write Open with a host ID, no
//     session of that host ID and export with an older generation has
//     grants, a connection, or anything in flight that can still reach the
//     cache; its Done and Flush, should any arrive, are refused with
//     CodeStale. A live session of another attach of the host is never
//     fenced but by an Open with OpenTakeover.
//   - Reserved fields and undefined flag bits are zero, and decoders reject
//     anything else (ErrReserved), so that decoding and re-encoding a message
//     gives back the same bytes.
//
// # Using this package
//
// The data path does not allocate: it encodes with Append into a reused
// buffer (a registered send buffer with capacity MaxMessageSize), and
// decodes a receive buffer with ParseHeader, then the Unmarshal method of a
// message value it keeps per type, on b[HeaderSize:HeaderSize+h.Length]
// after checking that the buffer holds that many bytes. Unmarshal reuses
// the slices of its receiver. Decode, which allocates a message of the
// header's type, is for tests, tools and fuzzing. Every decoding error
// wraps one of ErrBadMagic, ErrVersion, ErrReserved, ErrTooLarge,
// ErrTruncated, ErrTrailing, ErrUnknownType or ErrBadField; CodeOf maps
// them to CodeProto for an Error reply, and ErrorFor builds that reply from
// any error.
//
// # Wire format
//
// Integers are big-endian. Every message is a 24-byte header and a payload of
// at most MaxMessageSize-HeaderSize bytes; the whole is at most MaxMessageSize
// (4096) bytes. The diagrams give byte offsets.
//
// Header:
//
//	     0       1       2       3       4       5       6       7
//	   +-------------------------------+-------+-------+---------------+
//	 0 |   magic 0x52424C4B ("RBLK")   |version| type  |    credits    |
//	   +-------------------------------+-------+-------+---------------+
//	 8 |            length             |           reserved            |
//	   +-------------------------------+-------------------------------+
//	16 |                              tag                              |
//	   +---------------------------------------------------------------+
//
// The fields:
//
//   - magic: Magic, "RBLK" in ASCII.
//   - version: Version (1).
//   - type: the Type of the payload.
//   - credits: receive buffers the sender re-posted for its peer since its
//     last message.
//   - length: the payload's size; at most MaxMessageSize-HeaderSize.
//   - reserved: zero.
//   - tag: the request id chosen by the requester; a reply carries its
//     request's tag.
//
// Hello (1), 16 bytes. Versions are 1 <= min ver <= max ver. Features is a set
// of optional features (FeatureMask: FeatureOpenInstance, 1); unknown bits are
// ignored. Recv credits is the number of receive buffers the sender posted for
// its peer, max message the largest message (header included) it accepts.
//
//	    0       1       2       3       4       5       6       7
//	  +-------+-------+---------------+-------------------------------+
//	0 |min ver|max ver|   reserved    |           features            |
//	  +-------+-------+---------------+-------------------------------+
//	8 | recv credits  |   reserved    |          max message          |
//	  +---------------+---------------+-------------------------------+
//
// Error (2), 6 bytes and the text. Code is an ErrorCode (Linux errno numbers);
// text is at most MaxErrorText bytes of UTF-8.
//
//	    0       1       2       3       4       5       6       7
//	  +-------------------------------+---------------+---------------+
//	0 |             code              |   text len    | text          ~
//	  +-------------------------------+---------------+---------------+
//
// ListExports (3), OK (12), Credit (17) and KeepAlive (18) have no payload.
//
// ExportList (4), 2 bytes and the entries, all in one message:
//
//	    0       1       2       3       4       5       6       7
//	  +---------------+-----------------------------------------------+
//	0 |     count     | entries (count of them, packed)               ~
//	  +---------------+-----------------------------------------------+
//
// and each entry, packed without padding (len is the name's length):
//
//	offset   size  field
//	0        1     name len: 1 to 255
//	1        len   name: UTF-8, no NUL
//	1+len    8     size: the volume's size in bytes
//	9+len    4     flags: VolumeFlags
//
// Open (5), 8 bytes, the instance (8 bytes, with OpenInstance only), the
// name and the host ID. Mode is ModeReadOnly (0) or ModeReadWrite (1);
// flags: OpenTakeover (1, read-write only), OpenInstance (2: the instance
// follows, never 0; sent only to a target whose Hello offers
// FeatureOpenInstance); the name, 1 to MaxNameLen bytes of UTF-8 without
// NUL; the host ID, 0 to MaxNameLen bytes of UTF-8 without NUL (0:
// anonymous). The host ID follows the name without padding.
//
//	     0       1       2       3       4       5       6       7
//	   +-------+-------+---------------+---------------+---------------+
//	 0 | mode  | flags |   name len    |  host ID len  |   reserved    |
//	   +-------+-------+---------------+---------------+---------------+
//	 8 |            instance (only with OpenInstance)                  |
//	   +---------------------------------------------------------------+
//	16 | name (name len bytes), then host ID (host ID len bytes)       ~
//	   +---------------------------------------------------------------+
//
// Without OpenInstance the name starts at byte 8.
//
// Join (23), 16 bytes, the name and the host ID (1 to MaxNameLen bytes:
// never anonymous). Mode as in Open; flags reserved; the session
// generation is VolumeInfo's of the session's Open.
//
//	     0       1       2       3       4       5       6       7
//	   +-------+-------+---------------+---------------+---------------+
//	 0 | mode  | flags |   name len    |  host ID len  |   reserved    |
//	   +-------+-------+---------------+---------------+---------------+
//	 8 |                      session generation                       |
//	   +---------------------------------------------------------------+
//	16 | name (name len bytes), then host ID (host ID len bytes)       ~
//	   +---------------------------------------------------------------+
//
// VolumeInfo (6), 40 bytes, the reply to Open. Flags are VolumeFlags.
// Generation is the session's, never 0. Instance names the target process
// (random; another after a restart).
//
//	     0       1       2       3       4       5       6       7
//	   +-------------------------------+-------------------------------+
//	 0 |            handle             |             flags             |
//	   +-------------------------------+-------------------------------+
//	 8 |                          volume size                          |
//	   +-------------------------------+-------------------------------+
//	16 |          block size           |          chunk size           |
//	   +-------------------------------+-------------------------------+
//	24 |                      session generation                       |
//	   +---------------------------------------------------------------+
//	32 |                        target instance                        |
//	   +---------------------------------------------------------------+
//
// GrantRequest (7), 16 bytes. Flags: GrantWrite (1). Offset is any offset in
// the wanted chunk.
//
//	    0       1       2       3       4       5       6       7
//	  +-------------------------------+-------------------------------+
//	0 |            handle             |             flags             |
//	  +-------------------------------+-------------------------------+
//	8 |                            offset                             |
//	  +---------------------------------------------------------------+
//
// Grant (8), 40 bytes, the reply to GrantRequest. Flags: GrantWrite if the
// region is writable. Offset is the chunk's start in the volume.
//
//	     0       1       2       3       4       5       6       7
//	   +-------------------------------+-------------------------------+
//	 0 |            handle             |             flags             |
//	   +-------------------------------+-------------------------------+
//	 8 |                            offset                             |
//	   +---------------------------------------------------------------+
//	16 |                             addr                              |
//	   +-------------------------------+-------------------------------+
//	24 |             rkey              |            length             |
//	   +-------------------------------+-------------------------------+
//	32 |                          generation                           |
//	   +---------------------------------------------------------------+
//
// Revoke (9) and RevokeAck (10), 24 bytes. Handle, offset and generation
// are the grant's.
//
//	     0       1       2       3       4       5       6       7
//	   +-------------------------------+-------------------------------+
//	 0 |            handle             |           reserved            |
//	   +-------------------------------+-------------------------------+
//	 8 |                            offset                             |
//	   +---------------------------------------------------------------+
//	16 |                          generation                           |
//	   +---------------------------------------------------------------+
//
// Done (11), 24 bytes and 16 for each range. Flags: DoneFUA (1). Count is 1
// to MaxDoneRanges (253); no range is empty or wraps around 2^64. Session
// generation is VolumeInfo's, never 0.
//
//	     0       1       2       3       4       5       6       7
//	   +-------------------------------+-------------------------------+
//	 0 |            handle             |             flags             |
//	   +-------------------------------+-------------------------------+
//	 8 |             count             |           reserved            |
//	   +-------------------------------+-------------------------------+
//	16 |                      session generation                       |
//	   +---------------------------------------------------------------+
//	24 |                        range 0: offset                        |
//	   +---------------------------------------------------------------+
//	32 |                        range 0: length                        |
//	   +---------------------------------------------------------------+
//	40 | more ranges, up to count                                      ~
//	   +---------------------------------------------------------------+
//
// Flush (13), 16 bytes. Session generation is VolumeInfo's, never 0.
//
//	    0       1       2       3       4       5       6       7
//	  +-------------------------------+-------------------------------+
//	0 |            handle             |           reserved            |
//	  +-------------------------------+-------------------------------+
//	8 |                      session generation                       |
//	  +---------------------------------------------------------------+
//
// Close (16), 8 bytes.
//
//	    0       1       2       3       4       5       6       7
//	  +-------------------------------+-------------------------------+
//	0 |            handle             |           reserved            |
//	  +-------------------------------+-------------------------------+
//
// Trim (14) and WriteZeroes (15), 24 bytes. Flags: FlagFUA (1), and for
// WriteZeroes FlagNoHole (2). The range does not wrap around 2^64.
//
//	     0       1       2       3       4       5       6       7
//	   +-------------------------------+-------------------------------+
//	 0 |            handle             |             flags             |
//	   +-------------------------------+-------------------------------+
//	 8 |                            offset                             |
//	   +---------------------------------------------------------------+
//	16 |                            length                             |
//	   +---------------------------------------------------------------+
//
// AuthStart (19) and AuthChallenge (20), 40 bytes and the identity (the
// host ID, 0 to MaxNameLen bytes; the target ID, the same). Flags:
// AuthHaveSecret (1) in AuthStart, AuthRequired (1) in AuthChallenge. The
// challenge is ChallengeSize random bytes.
//
//	    0       1       2       3       4       5       6       7
//	  +-------+-------+---------------+-------------------------------+
//	0 | flags | rsvd  | identity len  |           reserved            |
//	  +-------+-------+---------------+-------------------------------+
//	8 | challenge (32 bytes)                                          ~
//	  +---------------------------------------------------------------+
//	40| identity (identity len bytes)                                 ~
//	  +---------------------------------------------------------------+
//
// Resize (24), 16 bytes, a notice (tag 0). Handle is the connection's
// handle of the volume; volume size its new size in bytes, never 0.
//
//	    0       1       2       3       4       5       6       7
//	  +-------------------------------+-------------------------------+
//	0 |            handle             |           reserved            |
//	  +-------------------------------+-------------------------------+
//	8 |                          volume size                          |
//	  +---------------------------------------------------------------+
//
// AuthResponse (21) and AuthAccept (22), 32 bytes: the proof, an
// HMAC-SHA256 (see package auth).
package protocol
