//go:build race

package nbd

// raceEnabled: the race detector allocates and makes sync.Pool drop items.
const raceEnabled = true
