package target

// SetTestHookOpening sets the hook an Open runs between the checks of the
// export and the addition of its handle (nil: none).
func SetTestHookOpening(f func(host string)) { testHookOpening = f }
