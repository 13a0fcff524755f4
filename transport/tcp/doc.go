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
// one ACK each time it has drained what it had buffered, not one per
// request. A SEND, WRITE or WRITE WITH IMMEDIATE completes when acknowledged,
// a READ when its data is placed; completions of the send queue come in
// send-queue order. At most Limits().MaxReadsInFlight READs are outstanding
// (the smaller of both sides' Options.MaxReadsInFlight); later ones are held
// back, in order, with whatever was posted after them.
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
// A Conn has a reader goroutine and a writer goroutine. Only the writer
// writes to the stream; the reader never waits for it, it only queues work:
// READ responses (at most this side's MaxReadsInFlight, which the peer was
// told at connect time), one cumulative ACK and one NAK. With the posted
// requests (at most SendQueueDepth) that bounds what the writer may have to
// send, so two peers each blocked writing READ responses to the other cannot
// deadlock: their readers keep reading. The writer hands up to 64 frames to
// one writev (header and payload as separate buffers, payloads from the
// registered memory with no copy), and writes as soon as it has output.
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
package tcp
