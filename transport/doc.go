// Package transport defines the connection interface the rblk data path runs
// on: RDMA reliable-connection semantics, whatever carries them.
//
// A Provider dials and listens; a Conn is one reliable connection with its own
// protection domain: memory registered on it (Register) can only be reached
// through it. Work is posted (PostSend, PostRecv) and its end is reported as
// Completions (Poll), as with verbs:
//
//   - two-sided SEND/RECV carries control messages: the receiver posts
//     buffers, each SEND consumes one;
//   - one-sided RDMA READ and RDMA WRITE (with or without immediate data) move
//     data between a local region and a peer's region named by address and
//     rkey, without the peer's CPU;
//   - work requests on one Conn execute in order, so a SEND after a WRITE is
//     seen only after the WRITE's data is placed;
//   - the first failure (for example a remote access error) breaks the
//     connection and flushes everything else in flight.
//
// Implementations live in their own packages: transport/tcp emulates a NIC
// over a TCP or unix stream for hosts without RDMA hardware and for tests,
// transport/rdma uses libibverbs and librdmacm.
//
// # Caller's duties
//
//   - A buffer given to PostSend or PostRecv belongs to the provider until
//     its completion has been returned by Poll.
//   - Only one goroutine should Poll a Conn; it dispatches completions.
//   - Deregister a region only after the operations that use it completed;
//     Free a Memory only after every region over it is deregistered.
//   - Memory handed to hardware comes from AllocMemory, never the Go heap.
package transport
