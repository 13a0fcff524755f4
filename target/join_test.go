package target_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"

	"github.com/rblk/rblk/protocol"
)

// join dials as host and joins the session of generation gen.
func (e *env) join(host, hostID string, gen uint64) (*client, error) {
	return e.dialOpen(host, false, 0, &protocol.Join{Mode: protocol.ModeReadWrite, Name: "vol", HostID: hostID, Generation: gen})
}

// TestJoin: a connection joins the current session of its host as an IO
// queue, with the session's generation; its writes land; a join of
// another generation or for another host is refused; a later Open of the
// host fences the queue with its session; the end of the session's first
// connection closes its queues.
func TestJoin(t *testing.T) {
	e := start(t, false, make([]byte, 1<<20))
	if _, err := e.dialAs("host-a", false, 0); err != nil { // an older generation
		t.Fatal(err)
	}
	first, err := e.dialAs("host-a", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	gen := first.info.Generation
	q, err := e.join("host-a", "host-a", gen)
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	if q.info.Generation != gen {
		t.Fatalf("joined queue has generation %d, the session %d", q.info.Generation, gen)
	}
	data := bytes.Repeat([]byte("queue"), 800)
	if err := q.writeChunk(t, 64<<10, data, gen); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := q.Request(ctx, &protocol.Flush{Handle: q.info.Handle, Generation: gen}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	file, err := os.ReadFile(e.path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file[64<<10:64<<10+len(data)], data) {
		t.Fatal("the queue's write is not in the file after its flush")
	}

	for _, tc := range []struct {
		name, host, hostID string
		gen                uint64
		want               error
	}{
		{"another generation", "host-a", "host-a", gen + 100, protocol.ErrStale},
		{"an older generation", "host-a", "host-a", gen - 1, protocol.ErrStale},
		{"a host without a session", "host-b", "host-b", gen, protocol.ErrStale},
		{"a host ID not the connection's", "host-b", "host-a", gen, protocol.ErrAccess},
	} {
		if _, err := e.join(tc.host, tc.hostID, tc.gen); !errors.Is(err, tc.want) {
			t.Errorf("join of %s: %v, want %v", tc.name, err, tc.want)
		}
	}
	if first.Err() != nil || q.Err() != nil {
		t.Fatalf("refused joins took the session down: %v, %v", first.Err(), q.Err())
	}

	// The host opens the export again: both connections of its session
	// are fenced.
	cur, err := e.dialAs("host-a", false, 0)
	if err != nil {
		t.Fatal(err)
	}
	waitDown(t, q.Link, "the joined queue of a fenced session")
	waitDown(t, first.Link, "the fenced session")
	if _, err := e.join("host-a", "host-a", gen); !errors.Is(err, protocol.ErrStale) {
		t.Fatalf("join of the fenced session: %v, want ErrStale", err)
	}

	// The end of the first connection ends the session and its queues.
	q2, err := e.join("host-a", "host-a", cur.info.Generation)
	if err != nil {
		t.Fatal(err)
	}
	cur.Close()
	waitDown(t, q2.Link, "a queue whose session's first connection ended")
}
