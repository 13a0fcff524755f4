package transporttest

import (
	"errors"

	"github.com/rblk/rblk/transport"
)

// Refused tells whether err is how an RDMA WRITE that the peer's memory
// checks refuse can end: with a remote access error, or flushed.
//
// The responder's NAK moves its queue pair to the error state too, and
// its owner disconnects; on rxe the disconnect can move the requester's
// queue pair to the error state before the requester's completer has read
// the NAK, which it then drops, and the WRITE is flushed (seen in the guest
// on 6.12 under a CPU hog). Either way the WRITE did not complete, but a
// flush does not prove the peer refused it: a caller checks the bytes it
// aimed at as well.
func Refused(err error) bool {
	if errors.Is(err, transport.ErrRemoteAccess) {
		return true
	}
	var ce *transport.CompletionError
	return errors.As(err, &ce) && ce.Op == transport.OpWrite && ce.Status == transport.StatusFlushed
}
