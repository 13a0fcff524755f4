//go:build !race

package nbd

const raceEnabled = false
