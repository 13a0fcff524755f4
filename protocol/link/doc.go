// Package link runs the rblk control protocol over one transport.Conn.
//
// A Link posts a ring of receive buffers for the peer's control messages and
// sends its own from a ring of registered send buffers, with credit-based
// flow control so that a SEND never meets a peer without a posted receive:
// each side announces in its hello (carried in the connection's private
// data) how many receives it posted, every SEND spends one credit, and the
// receiver returns credits in the header of its next message, or in a
// Credit message once half of its buffers were re-posted. One credit is kept
// for Credit messages so the two sides can never both wait for credits;
// they go from a goroutine of their own, which no other message (not even
// the answer to a KeepAlive, which waits for a credit like any) holds up.
//
// On top of that a Link offers what both ends of rblk need:
//
//   - Request sends a message and waits for the reply with its tag;
//   - Send sends one-way messages and replies (in order, per goroutine);
//   - RDMA posts a chain of one-sided READs and WRITEs and waits for all;
//   - the Handler sees every message that is not a reply, but KeepAlive,
//     which the link answers itself (a peer that asks more than 8 times
//     without reading the answers breaks the link);
//   - Start posts a chain and calls back at its end, on the completion
//     goroutine; a callback may Defer work (a Flusher) to the end of the
//     batch of completions it is part of, to do it once for them all.
//
// The link owns the connection's send queue: its SENDs have the room of
// their send slots kept for them, and RDMA chains wait (with the caller's
// context) for the rest, in pieces when longer than it, so a full queue
// never fails an operation or takes the link down.
//
// It also watches the peer, with one watchdog goroutine and no timer per
// operation: with Options.KeepAlive it probes a quiet link and declares it
// dead (ErrTimeout) after that much silence; with Options.RequestTimeout
// (or RequestWithin) a reply or an RDMA completion that does not come in
// time takes the link down the same way, and the connection is closed so
// that everything in flight completes.
//
// # Caller's duties
//
//   - The Handler runs on the completion goroutine: it must not block, and
//     must hand off to a goroutine anything that sends.
//   - RDMA operations cannot be cancelled once posted: their buffers stay
//     in use until they complete or the link breaks.
//   - A link that went down stays down: make a new one (the initiator
//     reconnects; the target ends the session).
//   - Close the link; it closes the connection and waits for its goroutines.
package link
