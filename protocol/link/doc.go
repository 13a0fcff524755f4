// Package link runs the rblk control protocol over one transport.Conn.
//
// A Link posts a ring of receive buffers for the peer's control messages and
// sends its own from a ring of registered send buffers, with credit-based
// flow control so that a SEND never meets a peer without a posted receive:
// each side announces in its hello (carried in the connection's private
// data) how many receives it posted, every SEND spends one credit, and the
// receiver returns credits in the header of its next message, or in a
// Credit message once half of its buffers were re-posted. One credit is kept
// for Credit messages so the two sides can never both wait for credits.
//
// On top of that a Link offers what both ends of rblk need:
//
//   - Request sends a message and waits for the reply with its tag;
//   - Send sends one-way messages and replies (in order, per goroutine);
//   - RDMA posts a chain of one-sided READs and WRITEs and waits for all;
//   - the Handler sees every message that is not a reply.
//
// # Caller's duties
//
//   - The Handler runs on the completion goroutine: it must not block, and
//     must hand off to a goroutine anything that sends.
//   - RDMA operations cannot be cancelled once posted: their buffers stay
//     in use until they complete or the link breaks.
//   - Close the link; it closes the connection and waits for its goroutines.
package link
