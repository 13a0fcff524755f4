// Package faultproxy is a TCP proxy that injects network faults between two
// real processes, for tests: rblk-attach dials the proxy instead of rblkd,
// and the test breaks, stalls, delays or reorders the link from outside the
// code under test.
//
//	p, err := faultproxy.New("127.0.0.1:0", targetAddr)
//	defer p.Close()
//	// start the client with p.Addr() as its target ...
//	c, err := p.WaitConn(ctx, 0)            // the first connection accepted
//	err = c.WaitFor(ctx, faultproxy.ReceivedAtLeast(faultproxy.ClientToServer, 1<<20))
//	c.Reset()                               // both sides see a TCP RST
//
// Every accepted connection is a *Conn with its own two forwarding
// goroutines, one per Direction. The faults, on one Conn or on all of them
// (the Proxy methods, which also apply to connections accepted later where
// that makes sense):
//
//   - Reset: both sockets are closed with SO_LINGER 0, so both peers see a
//     connection reset.
//   - ResetClientSideOnly: the client sees a reset; the server's socket of
//     the connection stays open, and what the server sends on it is read
//     and dropped. Bytes held back from the client (HoldBack) can still be
//     delivered to the server with Release: the late frames of a
//     connection its client considers dead.
//   - Stall and Resume: nothing is forwarded in either direction and
//     nothing is sent: the link is silent, not broken. The proxy stops
//     reading too (a read already under way keeps what it gets for the
//     Resume), so the senders' socket buffers fill as on a dead path.
//   - SetDelay: every chunk of bytes read in one direction is delivered no
//     earlier than the delay after it was read.
//   - HoldBack and Release: bytes read in one direction are kept instead of
//     delivered, until Release writes them, in order, to the other side.
//
// Tests wait for events instead of sleeping: Proxy.WaitConn for a
// connection to be accepted, Conn.WaitFor for a condition on the
// connection's Stats (bytes received from one side, delivered to the other,
// held back; a side closed), with the deadline of a context.
//
// Close stops accepting, closes every connection (with a reset) and waits
// for every goroutine of the proxy; it is safe to call more than once.
// Connections end by themselves when both peers closed them: an EOF from
// one side is passed on as a half-close (FIN) to the other, a reset as a
// reset.
package faultproxy
