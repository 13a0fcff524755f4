//go:build !linux

package transport

// CheckNotFileMapping is a no-op where /proc/self/maps does not exist.
func CheckNotFileMapping(buf []byte) error { return nil }
