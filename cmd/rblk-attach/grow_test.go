package main

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// The grow hook logs a grow before a front end is set, passes on at once
// a grow that happened while the front end was set up, then each later
// one, in order, with the size the front end had; a size not larger than
// the front end's changes nothing.
func TestGrowHook(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	g := newGrowHook(zap.New(core), "vol0")
	g.onResize(1<<20, 2<<20)
	var calls [][2]uint64
	g.set(1<<20, 3<<20, func(o, n uint64) { calls = append(calls, [2]uint64{o, n}) })
	g.onResize(2<<20, 3<<20) // the volume's call for the grow set passed on already
	g.onResize(3<<20, 4<<20)
	want := [][2]uint64{{1 << 20, 3 << 20}, {3 << 20, 4 << 20}}
	if len(calls) != len(want) || calls[0] != want[0] || calls[1] != want[1] {
		t.Fatalf("front end calls %v, want %v", calls, want)
	}
	if e := logs.All(); len(e) != 1 || e[0].Message != "vol0 grew from 1.0MiB to 2.0MiB" {
		t.Fatalf("logs %+v", e)
	}
	g.nbdSocket(1<<30, 2<<30)
	if e := logs.All(); e[len(e)-1].Message != "vol0 grew from 1.0GiB to 2.0GiB; NBD clients see the new size at their next handshake" {
		t.Fatalf("NBD socket log %q", e[len(e)-1].Message)
	}
	core2, logs2 := observer.New(zap.InfoLevel)
	g2 := newGrowHook(zap.New(core2), "vol0")
	g2.ublkDevice("/dev/ublkb0")(1<<30, 2<<30)
	if e := logs2.All(); len(e) != 1 || e[0].Level != zap.WarnLevel ||
		e[0].Message != "vol0 grew from 1.0GiB to 2.0GiB; /dev/ublkb0 keeps its old size until it is attached again (ublk devices are not resized live)" {
		t.Fatalf("ublk log %+v", e)
	}
}
