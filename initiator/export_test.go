package initiator

// SetTestHookWriteAcked makes f run when a synchronous write is about to
// be acknowledged to its caller (nil: nothing runs). Not with tests in
// parallel.
func SetTestHookWriteAcked(f func()) { testHookWriteAcked = f }

// DoneWindow is doneWindow, for the tests of Done batches.
const DoneWindow = doneWindow

// SetTestHookWouldWait makes a Done batch posted from a link callback take
// the way of a link without a free send slot or credit (a goroutine that
// waits for one) while f returns true (nil: never). Not with tests in
// parallel.
func SetTestHookWouldWait(f func() bool) { testHookWouldWait = f }
