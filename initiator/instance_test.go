package initiator_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/internal/faultproxy"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

// TestSecondAttachOfHostRefused: a second read-write attach of the export
// by the same host ID (another volume: another instance) is refused with
// ErrBusy, and the error names the first (its instance) and says how to
// take it over; the first is not fenced and its IO goes on. (Before
// instances, the second silently fenced the first.)
func TestSecondAttachOfHostRefused(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
	first := r.openWith(initiator.Options{HostID: "host-1", ReconnectTimeout: 10 * time.Second})
	if err := write(t, first, 0, []byte("first"), false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	second, err := initiator.Open(ctx, initiator.Options{Provider: r.p, Target: r.addr, Export: "vol", HostID: "host-1"})
	if err == nil {
		second.Close(ctx)
		t.Fatal("a second attach of the host opened the export its first attach holds")
	}
	if !errors.Is(err, protocol.ErrBusy) {
		t.Fatalf("second attach: %v, want ErrBusy", err)
	}
	for _, want := range []string{"instance " + initiator.FormatInstance(first.Instance()), "rblk-attach --takeover"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("second attach's error %q does not say %q", err, want)
		}
	}
	// The first goes on: not fenced, its writes land.
	if err := write(t, first, 4096, []byte("still mine"), false); err != nil {
		t.Fatalf("the first attach after the refusal: %v", err)
	}
	if err := first.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := first.Err(); err != nil {
		t.Fatalf("the first attach failed: %v", err)
	}
	if n := metric(t, r.reg, "rblkd_sessions_fenced_total"); n != 0 {
		t.Fatalf("%v sessions fenced", n)
	}
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if string(file[:5]) != "first" || string(file[4096:4106]) != "still mine" {
		t.Fatalf("file holds %q, %q", file[:5], file[4096:4106])
	}
}

// TestSameInstanceReconnectReinstates: the link of an attach breaks on its
// side only (the target still holds the old session: its socket stays
// open); the attach reconnects with its instance and the target
// reinstates it at once, fencing the old session, refusing nothing; IO
// goes on. (Were the instance made again per connection, the target would
// take the reconnect for another attach and refuse it.)
func TestSameInstanceReconnectReinstates(t *testing.T) {
	tcpOnly(t, "its fault is a TCP proxy that resets the initiator's side only; an RDMA disconnect reaches both sides")
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false, func(o *target.Options) {
		o.KeepAlive = 10 * time.Minute // the old session does not end by itself
		o.LivenessProbe = time.Minute  // nor would a probe find it dead in time
	})
	px, err := faultproxy.New("127.0.0.1:0", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer px.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	v, err := initiator.Open(ctx, initiator.Options{Provider: r.p, Target: px.Addr(), Export: "vol", HostID: "host-1",
		ReconnectTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close(context.Background())
	if err := write(t, v, 0, []byte("before"), false); err != nil {
		t.Fatal(err)
	}
	c, err := px.WaitConn(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	c.ResetClientSideOnly()
	if err := write(t, v, 4096, []byte("after"), false); err != nil {
		t.Fatalf("write across the reconnect: %v", err)
	}
	if err := v.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if px.Accepted() < 2 {
		t.Fatalf("%d connections: the attach did not reconnect", px.Accepted())
	}
	if n := metric(t, r.reg, "rblkd_sessions_fenced_total"); n != 1 {
		t.Fatalf("%v sessions fenced, want the old session of the attach", n)
	}
	if n := metric(t, r.reg, "rblkd_refused_total"); n != 0 {
		t.Fatalf("%v opens refused", n)
	}
	if err := v.Err(); err != nil {
		t.Fatal(err)
	}
	got, err := read(t, v, 4096, 5)
	if err != nil || string(got) != "after" {
		t.Fatalf("read %q, %v", got, err)
	}
}

// TestHungAttachDoesNotBlockSuccessor: the first attach's host hangs (its
// completions are held for seconds: it answers nothing); a second attach
// of the host, without Takeover, gets in once the target's liveness probe
// (300 ms) went unanswered, long before the target's keepalive (10 min)
// would have dropped the first; the second's writes land. When the first
// comes back it learns it was fenced, and by whom.
func TestHungAttachDoesNotBlockSuccessor(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false, func(o *target.Options) {
		o.KeepAlive = 10 * time.Minute
		o.LivenessProbe = 300 * time.Millisecond
	})
	in := faultnet.Wrap(r.p)
	first := r.openWith(initiator.Options{Provider: in, HostID: "host-1", ReconnectTimeout: 10 * time.Second})
	if err := write(t, first, 0, []byte("first"), false); err != nil {
		t.Fatal(err)
	}
	if err := first.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The hang: whatever the first receives from now on reaches it 5 s
	// late, far beyond the probe's bound.
	for _, c := range in.Conns() {
		c.Delay(5 * time.Second)
	}
	second := r.openWith(initiator.Options{HostID: "host-1"}) // fails the test if refused
	if err := write(t, second, 4096, []byte("second"), false); err != nil {
		t.Fatal(err)
	}
	if err := second.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if string(file[:5]) != "first" || string(file[4096:4102]) != "second" {
		t.Fatalf("file holds %q, %q", file[:5], file[4096:4102])
	}
	select {
	case <-first.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the hung attach, back, is still up")
	}
	// (It gets the fence notice, or, when its link broke first, the
	// refusal of its reconnect: either names the successor.)
	if err := first.Err(); !errors.Is(err, initiator.ErrFenced) || !strings.Contains(err.Error(), "instance "+initiator.FormatInstance(second.Instance())) {
		t.Fatalf("the hung attach ended with %v, want ErrFenced naming the successor", err)
	}
	t.Logf("the hung attach, back: %v", first.Err())
	for _, c := range in.Conns() {
		c.Delay(0)
	}
}
