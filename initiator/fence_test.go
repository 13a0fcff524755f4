package initiator_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

// TestTakeoverFencesOtherAttachOfHost: a second read-write attach of the
// same export by the same host ID with Takeover fences the first, which
// stops with ErrFenced (saying who took the export over) instead of
// reconnecting and fencing back; the second goes on. Read-only attaches
// of the same host are not fenced. (Without Takeover the second is
// refused: TestSecondAttachOfHostRefused.)
func TestTakeoverFencesOtherAttachOfHost(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
	first := r.openWith(initiator.Options{HostID: "host-1", ReconnectTimeout: 10 * time.Second})
	ro := r.openWith(initiator.Options{HostID: "host-1", ReadOnly: true})
	if err := write(t, first, 0, []byte("first"), false); err != nil {
		t.Fatal(err)
	}
	second := r.openWith(initiator.Options{HostID: "host-1", ReconnectTimeout: 10 * time.Second, Takeover: true})
	select {
	case <-first.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the first attach is still up after another attach of its host took the export over")
	}
	if err := first.Err(); !errors.Is(err, initiator.ErrFenced) || !strings.Contains(err.Error(), "instance "+initiator.FormatInstance(second.Instance())+") took export") {
		t.Fatalf("first attach ended with %v, want ErrFenced naming the second's instance", err)
	}
	if err := write(t, first, 0, []byte("stale"), false); err == nil {
		t.Fatal("the fenced attach still writes")
	}
	if err := write(t, second, 4096, []byte("second"), false); err != nil {
		t.Fatal(err)
	}
	if err := second.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, err := read(t, second, 0, 5)
	if err != nil || string(got) != "first" {
		t.Fatalf("read through the second: %q, %v", got, err)
	}
	if got, err := read(t, ro, 4096, 6); err != nil || string(got) != "second" {
		t.Fatalf("read-only attach of the same host: %q, %v", got, err)
	}
}

// TestLostDoneLosesNothing: a write whose RDMA WRITE reached the target but
// whose Done was lost with the connection was acknowledged, so it must not
// be lost: the target (the same process, still running) writes back every
// chunk the lost session held writable, and the initiator, back on the same
// target instance, reports nothing lost. (Before, the data sat in the cache
// without being marked dirty, never reached the file, and the next FLUSH
// failed with EIO.) Without a host ID the promise is not made: the next
// FLUSH reports the possible loss.
//
// The writer is held, once its Done is gone, until the volume has handled
// the loss of the connection (OnLink): the scheduling that the guest's
// soak met over rdma, made certain. A write acknowledged on a session must
// count as unflushed however late its goroutine runs. (Before, it was
// counted after it released the session, and the volume, which looked at
// the count as soon as the link was down, took it for flushed: the
// anonymous FLUSH returned OK.)
func TestLostDoneLosesNothing(t *testing.T) {
	for _, host := range []string{"host-1", ""} {
		t.Run("host="+host, func(t *testing.T) {
			r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
			fn := faultnet.Wrap(r.p)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			lost := make(chan struct{})
			var once sync.Once
			var hold atomic.Bool
			initiator.SetTestHookWriteAcked(func() {
				if !hold.Load() {
					return
				}
				select {
				case <-lost:
				case <-ctx.Done():
					t.Error("the volume did not handle the loss of its connection")
				}
			})
			defer initiator.SetTestHookWriteAcked(nil)
			v, err := initiator.Open(ctx, initiator.Options{Provider: fn, Target: r.addr, Export: "vol", HostID: host,
				ReconnectTimeout: 20 * time.Second, OnLink: func(up bool, _ int) {
					if !up {
						once.Do(func() { close(lost) })
					}
				}})
			if err != nil {
				t.Fatal(err)
			}
			defer v.Close(context.Background())
			if err := write(t, v, 0, []byte("warm"), false); err != nil { // grants in place
				t.Fatal(err)
			}
			if err := v.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			conns := fn.Conns()
			conns[len(conns)-1].LoseNextSend() // the initiator's side: its next Done
			hold.Store(true)
			data := bytes.Repeat([]byte("acked"), 1000)
			if err := write(t, v, 8192, data, false); err != nil {
				t.Fatalf("write whose Done is lost: %v", err)
			}
			hold.Store(false)
			err = v.Flush(ctx)
			if host == "" {
				if !errors.Is(err, initiator.ErrLostWrites) {
					t.Fatalf("anonymous: flush after the lost Done: %v, want ErrLostWrites", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("flush after a lost Done on the same target: %v", err)
			}
			file, err := os.ReadFile(r.path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(file[8192:8192+len(data)], data) {
				t.Fatal("an acknowledged write whose Done was lost is not in the file after FLUSH returned OK")
			}
		})
	}
}

// TestReconnectAttemptsAreBounded: a connection attempt that gets no answer
// (its connect request lost on a link that is down) is given up after a
// while and tried again, instead of using up the whole reconnect time
// (seen with RDMA CM after a link fault in the guest).
func TestReconnectAttemptsAreBounded(t *testing.T) {
	tcpOnly(t, "its black hole is a TCP listener on the target's address")
	path := filepath.Join(t.TempDir(), "vol.img")
	r := startTargetAt(t, path, "127.0.0.1:0", 1<<20, 1<<20, 64<<10, false)
	addr := r.addr
	v := r.openWith(initiator.Options{HostID: "host-1", IOTimeout: 500 * time.Millisecond, ReconnectTimeout: 60 * time.Second})
	if err := write(t, v, 0, []byte("before"), false); err != nil {
		t.Fatal(err)
	}
	r.stop()
	// A black hole on the target's address: it accepts and never answers.
	hole, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := hole.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	select {
	case c := <-accepted:
		held = append(held, c) // kept open: that attempt hangs
	case <-time.After(20 * time.Second):
		t.Fatal("the volume did not try to reconnect")
	}
	hole.Close()
	for c := range accepted {
		held = append(held, c)
	}
	startTargetAt(t, path, addr, 1<<20, 1<<20, 64<<10, false)
	start := time.Now()
	res := make(chan error, 1)
	go func() { res <- write(t, v, 4096, []byte("after"), false) }()
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("write after the target came back: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("IO still waits 15 s after the target came back: a hung connection attempt holds the reconnect")
	}
	t.Logf("IO went on %v after the target came back", time.Since(start).Round(time.Millisecond))
}
