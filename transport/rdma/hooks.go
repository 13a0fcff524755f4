//go:build linux

package rdma

// testHooks run at chosen points of a conn's code, so that a test can
// make another goroutine act exactly there (a Close between two steps
// of a window request) instead of hoping a timing hits it. A provider
// made by New has none (nil): each hook is then a nil check.
type testHooks struct {
	// AfterStartOp runs when a bind or an invalidation has its slot and
	// wr_id and is about to be posted.
	AfterStartOp func(c *conn, op *mwOp)
	// DrainCounted runs when Close's drain has counted the requests not
	// yet flushed (left > 0) and is about to poll and wait for them.
	DrainCounted func(c *conn)
}

func (h *testHooks) afterStartOp(op *mwOp) {
	if h != nil && h.AfterStartOp != nil {
		h.AfterStartOp(op.w.c, op)
	}
}

func (h *testHooks) drainCounted(c *conn) {
	if h != nil && h.DrainCounted != nil {
		h.DrainCounted(c)
	}
}
