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
}

func (h *testHooks) afterStartOp(op *mwOp) {
	if h != nil && h.AfterStartOp != nil {
		h.AfterStartOp(op.w.c, op)
	}
}
