//go:build linux && cgo && rdma && rdmacfake

package verbs

import (
	"errors"
	"sync"
	"syscall"
	"testing"
)

// TestPostCountsPerQueue posts failing chains of sends and of receives at
// the same time, as a conn does under its send and receive locks: each post
// must report how many of its own chain went before the refused request,
// whatever the other queue's post did meanwhile.
func TestPostCountsPerQueue(t *testing.T) {
	const sendOK, recvOK, n = 3, 5, 8
	qp, err := newFakeQP(fakeQPConfig{Chunk: n, FailSendAt: sendOK, FailRecvAt: recvOK, PerCall: true, Errno: syscall.EINVAL})
	if err != nil {
		t.Fatal(err)
	}
	defer qp.Destroy()
	for i := range n {
		qp.SendBuf()[i] = WR{ID: uint64(i), Opcode: WRSend, Flags: FlagSignaled}
		qp.RecvBuf()[i] = WR{ID: uint64(i)}
	}
	const rounds = 200000
	var wg sync.WaitGroup
	var sendBad, recvBad int
	var sendErr, recvErr error
	wg.Add(2)
	go func() {
		defer wg.Done()
		for range rounds {
			k, err := qp.PostSend(n)
			if !errors.Is(err, syscall.EINVAL) {
				sendErr = err
				return
			}
			if k != sendOK {
				sendBad++
			}
		}
	}()
	go func() {
		defer wg.Done()
		for range rounds {
			k, err := qp.PostRecv(n)
			if !errors.Is(err, syscall.EINVAL) {
				recvErr = err
				return
			}
			if k != recvOK {
				recvBad++
			}
		}
	}()
	wg.Wait()
	if sendErr != nil || recvErr != nil {
		t.Fatalf("post errors %v, %v; want EINVAL", sendErr, recvErr)
	}
	if sendBad != 0 || recvBad != 0 {
		t.Errorf("of %d failed posts each, %d sends reported a count other than %d, %d receives one other than %d", rounds, sendBad, sendOK, recvBad, recvOK)
	}
}

// TestFakeQPRecords checks the fake itself: what it takes, and the one
// refusal.
func TestFakeQPRecords(t *testing.T) {
	qp, err := newFakeQP(fakeQPConfig{Chunk: 4, FailSendAt: 5, FailRecvAt: -1, Record: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer qp.Destroy()
	for round := range 2 {
		for i := range 4 {
			qp.SendBuf()[i] = WR{ID: uint64(round*4 + i)}
		}
		k, err := qp.PostSend(4)
		if round == 0 && (k != 4 || err != nil) {
			t.Fatalf("first post: %d, %v", k, err)
		}
		if round == 1 && (k != 1 || !errors.Is(err, syscall.ENOMEM)) {
			t.Fatalf("second post: %d, %v; want 1, ENOMEM", k, err)
		}
	}
	sends, _ := qp.posted()
	if len(sends) != 5 || sends[4] != 4 {
		t.Errorf("posted %v", sends)
	}
}
