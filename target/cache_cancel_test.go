package target

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestGetCanceledLoadsAnyway: a get whose context has ended by the time it
// reaches an absent chunk (the grant of a session whose link just went
// down) still loads the chunk the table set aside for it, or leaves none.
// It used to return at once, leaving the chunk "loading" with no loader
// and no channel to wait on: every later grant of that chunk waited
// forever (TestFaultLinkReset caught it: after a reset, each new session's
// first grant hung until the initiator's request timeout, again and again).
func TestGetCanceledLoadsAnyway(t *testing.T) {
	tg, v, _ := benchTarget(t, 4<<20, 1<<20)
	c := tg.cache
	for idx := range uint64(4) {
		canceled, cancel := context.WithCancel(context.Background())
		cancel()
		if ch, _, err := c.get(canceled, nil, 0, v, idx); err == nil {
			c.unpin(ch)
		} else if !errors.Is(err, context.Canceled) {
			t.Fatalf("chunk %d, canceled get: %v", idx, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ch, _, err := c.get(ctx, nil, 0, v, idx)
		cancel()
		if err != nil {
			t.Fatalf("chunk %d: get after a canceled get: %v (a chunk left loading with no loader)", idx, err)
		}
		c.unpin(ch)
	}
}
