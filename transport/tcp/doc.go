// Package tcp is a software RDMA provider: it emulates what an RDMA NIC does
// for a reliable connection (RC), over a TCP or unix stream, for hosts
// without RDMA hardware and for tests.
//
//	p := tcp.New("tcp") // or tcp.New("unix"), or tcp.NewWithOptions
//	l, _ := p.Listen(ctx, "127.0.0.1:0")
//	conn, _ := p.Dial(ctx, l.Addr(), privateData)
//
// # What it emulates
//
// Each Conn is a queue pair with its own protection domain and completion
// queue. Memory registered on it (any []byte but a mapping of a file, which
// hardware must not pin either) gets a fresh 32-bit key (lkey and rkey are
// equal) and is named by the peer with the address of its first byte, as
// with verbs. A Conn is a transport.WindowBinder: a window over a span of a
// region registered with AccessBindWindow gets a key of its own from the
// same key space, known to this Conn only (a type-2 memory window bound to
// the QP), checked against the window's span and rights; Invalidate takes
// the key out and waits until no request of the peer still reads or writes
// the span (a WRITE's payload being placed, a READ's response not yet
// written). The responder side of one-sided operations lives in
// the provider, in the goroutine reading the stream: an RDMA WRITE is checked
// (rkey, bounds, AccessRemoteWrite) and its data read from the socket
// straight into the target region; an RDMA READ is checked
// (AccessRemoteRead) and answered with a response frame written from the
// region. A SEND consumes the oldest posted RECV; when none is posted the
// reader waits up to Options.RNRTimeout (the RNR retries of a NIC), which
// keeps the order of everything behind it. Unlike on a NIC, where requests
// and responses travel apart, that wait also holds up the READ responses and
// acknowledgements for this side's own requests that follow the SEND on the
// stream: post receives before the peer may send.
//
// Requests are numbered in send-queue order (the seq field, like PSNs) and
// executed in that order by the peer, which acknowledges them cumulatively:
// one ACK each time it is about to wait for more input (it has read all
// the stream had), not one per request; a READ response acknowledges its
// READ and what came before, so no ACK follows one that says no more. A
// SEND, WRITE or WRITE WITH IMMEDIATE completes when acknowledged, a READ
// when its data is placed;
// completions of the send queue come in send-queue order. At most
// Limits().MaxReadsInFlight READs are outstanding (the smaller of both
// sides' Options.MaxReadsInFlight); later ones are held back, in order,
// with whatever was posted after them.
//
// A request posted with WorkRequest.Unsignaled gets no completion when it
// succeeds. It keeps its room in the send queue (it counts against
// SendQueueDepth) until a later completion of the send queue is polled or
// delivered: that completion frees its own entry and those of the
// unsignaled requests that succeeded before it. A request that fails, or
// is flushed, completes with its status whether signaled or not.
//
// A Conn is a transport.CompletionHandler: after HandleCompletions(fn),
// completions are not queued for Poll but passed to fn, in the same
// order, by the goroutine where they arise (see below); a final
// fn(nil, err) with err matching transport.ErrClosed comes once, after
// every completion.
//
// The first failure breaks the connection as on an RC QP: the request that
// failed completes with its status (the peer reports a refused request with a
// NAK frame), and every other outstanding request and posted receive, on both
// sides, completes with StatusFlushed; Poll then returns transport.ErrClosed.
// Local checks (the SGE within a live region of the Conn, AccessLocalWrite
// for READ destinations and receive buffers) are done when posting; a request
// that fails them completes with StatusLocalProtectionError in its turn.
//
// As on hardware, the data of a READ response is taken from the region when
// the response is written, which may be after the responder executed
// requests that followed the READ: a requester that READs a span and then
// WRITEs it, or SENDs a message that lets the peer reuse it, must wait for
// the READ's completion first (what a fence does with verbs).
//
// # Goroutines and deadlock freedom
//
// A Conn has a reader goroutine and a writer goroutine. The stream is
// written by one goroutine at a time, whichever holds the conn's write
// token: any of them makes its writes with a single writev of up to 64
// frames (header and payload as separate buffers, payloads from the
// registered memory with no copy), in the order the frames were queued.
//
//   - A poster (PostSend) whose requests find none of the conn's in
//     flight (the queue-depth-1 case), the token free and no batch left
//     unfinished, takes the token and makes one non-blocking writev of
//     what is queued (syscall.RawConn.Write whose function never asks to
//     wait): the conn's lock is not held during it, and it never waits
//     for the socket. With requests in flight it wakes the writer
//     goroutine instead, which batches what is posted meanwhile (a write
//     per post would also make the peer acknowledge each). While the
//     reader is inside the completion handler, posts only queue: the
//     reader writes them when the handler returns, in one writev with the
//     ACK.
//   - The reader makes the same attempt, never waiting for the socket
//     either, each time it is about to wait for input: before a read(2)
//     that may wait (its buffer is empty; after a read that filled the
//     buffer, if it has something to do before waiting, it first tries a
//     non-blocking read, and goes on if that finds data) and before
//     waiting for a receive to be posted (RNR). That is where it queues
//     the cumulative ACK for what it executed, and it writes the READ
//     responses, the ACK and a NAK it queued, with whatever requests are
//     ready. A READ response is handed to the writer goroutine at once
//     when more frames are buffered behind its request, or more than
//     64 KiB of responses are queued.
//   - An attempt is made only when the writer goroutine is idle (not
//     writing, not woken) and all that is queued fits one batch with at
//     most 64 KiB of payload; otherwise the writer goroutine writes it
//     all, in one batch, while the reader goes on reading.
//   - What an attempt does not write (the socket buffer is full, the
//     budget, or output queued while the token was busy) is left to the
//     writer goroutine, woken for it, which finishes an unfinished batch
//     first and then writes, blocking, until nothing is queued. It is the
//     only goroutine that waits for the socket to take data. A stream
//     that is not a *net.TCPConn or *net.UnixConn has no inline attempts:
//     the writer goroutine writes all, woken by whoever queues output.
//   - The inline writevs and every read of the reader are raw system
//     calls (internal/rawsock): on a non-blocking socket they never
//     sleep, and a syscall.Syscall would wake the runtime's monitor
//     thread each time an idle process (queue depth 1) gets to work.
//
// The reader never waits for a write: it only queues output and makes
// non-blocking attempts. Its output is bounded: READ responses (at most
// this side's MaxReadsInFlight, which the peer was told at connect time),
// one cumulative ACK and one NAK. With the posted requests (at most
// SendQueueDepth) that bounds what the writer may have to send, so two
// peers each blocked writing to the other cannot deadlock: their readers
// keep reading, and make room.
//
// Completions arise on the reader (ACKs complete SENDs and WRITEs, READ
// responses complete READs, incoming SENDs and WRITEs WITH IMMEDIATE
// complete receives), at post (a request failing its local checks, which
// breaks the connection), and when a broken or closed connection is
// flushed, by the goroutine that waits for the reader and writer to be
// gone. With Poll they are queued for it and the goroutine in Poll woken.
// With a completion handler:
//
//   - the reader calls fn with what it completed at the same points where
//     it writes, before it waits: before a read(2) that may wait, and
//     before it waits for a receive (fn may post the receive the SEND
//     waits for).
//     It first writes what something may be waiting for (READ responses,
//     whose windows an Invalidate waits for; a NAK; requests ready to go),
//     then calls fn, then writes the ACK, which a request fn posted has
//     carried with it if the token was free;
//   - completions that arise elsewhere are delivered by the reader if it
//     is delivering at the time, else by the flushing goroutine once the
//     reader and writer are gone (a failure at post breaks the
//     connection, so it comes right before the flushes), and those
//     queued before HandleCompletions by a goroutine of its own:
//     never by a goroutine that posts, closes or calls HandleCompletions,
//     which may hold locks of its own that fn takes;
//   - one goroutine delivers at a time, in queue order, with no lock of
//     the conn held, so fn may post, register and close; a goroutine that
//     finds another delivering leaves what it queued to it. The room of a
//     completion is freed before fn gets it, so fn may repost at once;
//   - while fn runs on the reader, the reader executes nothing of the
//     peer's: a slow fn holds up the connection (the contract: fn must
//     not block). Before it calls fn it has handed the output that
//     anything may wait for to the stream or the writer goroutine, so
//     fn's own waits (none are allowed but Invalidate, which waits for
//     the windows in use) depend on no progress of the reader, except
//     for a WRITE the reader is placing through the window being
//     invalidated: that Invalidate waits for its ctx, then closes. What
//     is posted meanwhile (by fn or anyone) waits for fn to return; no
//     goroutine of the conn waits for it.
//
// Close (from anywhere, fn included) breaks the connection and waits until
// no goroutine of the conn touches the memory of requests: the reader and
// writer gone and the requests flushed, or, when the reader is inside fn
// (fn may be the caller, or wait for a lock the caller holds), the writer
// gone, no write attempt running, and the reader bound to stop, touching
// nothing, as soon as fn returns (it checks between frames and before
// each read). The flushed completions and the final call come after fn
// returns, from the flushing goroutine.
//
// # Frames
//
// Every frame is a fixed 32-byte header, big endian, followed by length
// bytes of payload:
//
//	 0       2      3        4                 8
//	+-------+------+--------+-----------------+
//	| magic | type | status |     length      |   magic 0x5242 ("RB")
//	+-------+------+--------+-----------------+
//	|                  seq                    |   8 bytes
//	+-----------------------------------------+
//	|              remote addr                |   8 bytes
//	+--------------------+--------------------+
//	|        rkey        |        imm         |   4 + 4 bytes
//	+--------------------+--------------------+
//	32                                         payload (length bytes)
//
// Frame types and the fields they use:
//
//	1 CONNECT    status=version, imm=initiator depth, payload=private data (≤56)
//	2 ACCEPT     status=version, imm=initiator depth, payload=private data (≤196)
//	3 REJECT     payload=private data (≤148)
//	4 SEND       seq, payload=message
//	5 WRITE      seq, addr, rkey, payload=data
//	6 WRITE_IMM  seq, addr, rkey, imm, payload=data
//	7 READ_REQ   seq, addr, rkey, imm=length to read (no payload)
//	8 READ_RESP  seq of the READ, payload=data
//	9 ACK        seq: every request up to seq was executed
//	10 NAK       seq: requests before seq were executed, seq failed with status
//
// length is at most 1 GiB. A frame with a bad magic, an unknown type, an
// absurd length, a sequence number out of order or anything else that makes
// no sense breaks that connection (never the process or other connections).
// A stream whose first frame is not a CONNECT is dropped by the listener.
//
// Until its CONNECT is read a stream is the listener's alone, invisible to
// its owner, so the listener bounds such streams itself
// (transport.HandshakeLimiter, Options.HandshakeTimeout and
// Options.MaxPendingHandshakes): a stream has HandshakeTimeout from its
// accept until Accept hands its request out (ConnRequest.AcceptedAt tells
// the owner when that was, so that its own timeout runs from there too);
// beyond MaxPendingHandshakes waiting streams, a new one is closed at once
// if its address holds the most of them, else it takes the place of the
// oldest stream of the address that does.
package tcp
