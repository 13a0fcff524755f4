package initiator

// SetTestHookWriteAcked makes f run when a synchronous write is about to
// be acknowledged to its caller (nil: nothing runs). Not with tests in
// parallel.
func SetTestHookWriteAcked(f func()) { testHookWriteAcked = f }

// DoneWindow is doneWindow, for the tests of Done batches.
const DoneWindow = doneWindow
