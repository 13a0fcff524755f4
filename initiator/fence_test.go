package initiator_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rblk/rblk/initiator"
)

// TestSameHostTwiceFencesTheFirst: a second read-write attach of the same
// export by the same host ID fences the first, which stops with ErrFenced
// instead of reconnecting and fencing back; the second goes on. Read-only
// attaches of the same host are not fenced.
func TestSameHostTwiceFencesTheFirst(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
	first := r.openWith(initiator.Options{HostID: "host-1", ReconnectTimeout: 10 * time.Second})
	ro := r.openWith(initiator.Options{HostID: "host-1", ReadOnly: true})
	if err := write(t, first, 0, []byte("first"), false); err != nil {
		t.Fatal(err)
	}
	second := r.openWith(initiator.Options{HostID: "host-1", ReconnectTimeout: 10 * time.Second})
	select {
	case <-first.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the first attach is still up after the same host opened the export again")
	}
	if err := first.Err(); !errors.Is(err, initiator.ErrFenced) {
		t.Fatalf("first attach ended with %v, want ErrFenced", err)
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
