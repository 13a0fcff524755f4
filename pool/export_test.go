package pool

// SetTestCrash sets the hook asked at each step of a create and a delete
// whether the process dies there (nil: none).
func SetTestCrash(f func(point string) bool) { testCrash = f }
