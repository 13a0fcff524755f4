package blockdev

import "context"

// Buffer is memory the backend lends for one request: the payload of a
// write is read from the front end's socket or queue straight into Segs,
// the data of a read is sent from Segs; the total length of Segs equals
// the request's length. In rblk it is memory registered for RDMA, so no
// copy is made between the front end and the network.
type Buffer struct {
	Segs [][]byte
	// Priv is the backend's: its state of the request.
	Priv any
}

// Len is the sum of the lengths of b's segments.
func (b *Buffer) Len() int {
	n := 0
	for _, s := range b.Segs {
		n += len(s)
	}
	return n
}

// Backend is the storage behind a block device. Its methods are called
// concurrently, from several requests of one connection or queue and from
// several connections or queues.
type Backend interface {
	// Alloc lends a buffer of exactly n bytes (0 < n ≤ the front end's
	// largest request), waiting while the backend's pool is exhausted
	// (ctx ends the wait). Free returns it, once the front end no longer
	// touches its memory.
	Alloc(ctx context.Context, n int) (*Buffer, error)
	Free(b *Buffer)
	// ReadAt fills b with the bytes at off.
	ReadAt(ctx context.Context, b *Buffer, off uint64) error
	// WriteAt stores b at off; with fua the data is durable on return.
	WriteAt(ctx context.Context, b *Buffer, off uint64, fua bool) error
	// Flush makes every write that returned before it was called durable.
	Flush(ctx context.Context) error
	// Trim discards a range (a hint: reads may return old data or zeroes).
	Trim(ctx context.Context, off, length uint64, fua bool) error
	// WriteZeroes makes a range read back as zeroes; with noHole the space
	// stays allocated.
	WriteZeroes(ctx context.Context, off, length uint64, noHole, fua bool) error
}

// Completion is told the end of a request started with a Submitter.
type Completion interface {
	// Complete reports the request's result: nil, or why it failed (an
	// error wrapping a syscall.Errno the front end can report). It is
	// called exactly once per request, from any goroutine: the one that
	// submitted, possibly before Submit returned, or the backend's
	// completion path, which it must not block (no waiting for a socket
	// or a lock held across IO).
	Complete(err error)
}

// BatchCompletion is a Completion whose front end can put a request's end
// off until more requests end: a backend that completes several requests in
// one pass (the completions of one poll of its completion queue) ends each
// with CompleteBatched and then calls Flush, once, on every Flusher it got,
// so that the front end sends their replies together (NBD: one writev for
// all of them where it would make one each).
type BatchCompletion interface {
	Completion
	// CompleteBatched reports the request's result, as Complete, except
	// that what the front end does with it may wait until the returned
	// Flusher's Flush (nil: nothing waits). The caller must then call
	// Flush, from the same pass and without blocking in between: a
	// request's end that waits holds the client's reply.
	CompleteBatched(err error) Flusher
}

// Flusher sends what a front end put off (BatchCompletion). Flush does
// not block, and ends every request put off before it.
type Flusher interface {
	Flush()
}

// Submitter is implemented by a Backend that can start a read or a write
// and report its end later, run to completion: the usual request is
// started on the front end's reader and finished on the backend's
// completion path, with no goroutine switch in between. A request that
// cannot go that way (it needs something fetched first, a connection is
// being re-established) is carried on by the backend in a goroutine of its
// own; the front end does not see the difference.
type Submitter interface {
	// SubmitRead starts reading b at off into b; c.Complete is called
	// once with the result. It may block as a backpressure (the backend's
	// queues are full), never for the request's own IO.
	SubmitRead(ctx context.Context, b *Buffer, off uint64, c Completion)
	// SubmitWrite starts writing b at off, as WriteAt; c.Complete is
	// called once with the result.
	SubmitWrite(ctx context.Context, b *Buffer, off uint64, fua bool, c Completion)
}

// Plugger is implemented by a Submitter that can hold back the requests
// submitted between Plug and Unplug and start them together at Unplug (on
// RDMA, one doorbell for the work requests of all of them), as the block
// layer's plugging does. A front end that has more requests at hand (read
// from its socket and not yet submitted) plugs before submitting them and
// unplugs once it has none left.
//
// Plug and Unplug are called by one goroutine at a time, the one that
// submits. It must call Unplug before it blocks on anything but the
// Submitter's own calls (its socket, a channel, a worker): the requests
// held back make no progress until then. The Submitter's own calls
// (Alloc, SubmitRead, SubmitWrite, and every call that waits) unplug
// first when they would wait. Neither call blocks.
type Plugger interface {
	Plug()
	Unplug()
}

// Queuer is implemented by a Backend with several queues, each with its
// own completion path (rblk: a connection to the target). A front end
// with several connections or hardware queues serves its i-th from
// Queue(i), so that a request and its completion stay on one queue, as
// nvme-rdma maps its IO queues to CPUs.
type Queuer interface {
	// Queue returns the backend of queue i (0 <= i; i modulo the
	// backend's queues): a Backend, and a Submitter if the Backend is
	// one, whose reads, writes, trims and zeroes go to that queue. Its
	// Flush covers every queue, as the Backend's.
	Queue(i int) Backend
}
