package admin

// SetListenHook makes Listen call f at its stages ("locked", "stale"; see
// listenHook) until the returned function restores the hook before. Not
// for parallel tests.
func SetListenHook(f func(path, stage string)) (restore func()) {
	old := listenHook
	listenHook = f
	return func() { listenHook = old }
}
