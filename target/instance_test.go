package target_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

// attachClient is a raw client of one attach: a host ID and an instance.
// notices gets the Error notices (tag 0) the target sends it.
type attachClient struct {
	*client
	notices chan protocol.ErrorMsg
}

// rwOpen is a read-write Open of "vol" by host with instance (0: an Open
// without one, as an older initiator sends it) and extra flags.
func rwOpen(host string, instance uint64, flags uint8) *protocol.Open {
	o := &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol", HostID: host, Flags: flags}
	if instance != 0 {
		o.Flags |= protocol.OpenInstance
		o.Instance = instance
	}
	return o
}

// attach dials e over p (e.p if nil) as open.HostID and sends open. The
// client is returned with the Open's error.
func (e *env) attach(p transport.Provider, open *protocol.Open) (*attachClient, error) {
	if p == nil {
		p = e.p
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	notices := make(chan protocol.ErrorMsg, 4)
	l, err := link.Dial(ctx, p, e.addr, link.Options{Handler: func(h protocol.Header, b []byte) {
		var em protocol.ErrorMsg
		if h.Type == protocol.TypeError && h.Tag == 0 && em.Unmarshal(b) == nil {
			select {
			case notices <- em:
			default:
			}
		}
	}})
	if err != nil {
		return nil, err
	}
	e.t.Cleanup(func() { l.Close() })
	c := &attachClient{client: &client{Link: l}, notices: notices}
	if _, err := auth.Initiate(ctx, l, open.HostID, nil); err != nil {
		return nil, err
	}
	return c, l.Request(ctx, open, &c.info)
}

// works checks that c's session still holds the export: a write through a
// grant, and a Flush of its generation, succeed.
func (c *attachClient) works(t *testing.T, off uint64, what string) {
	t.Helper()
	if err := c.writeChunk(t, off, []byte(what), c.info.Generation); err != nil {
		t.Fatalf("%s: write: %v", what, err)
	}
	if err := c.Request(context.Background(), &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatalf("%s: flush: %v", what, err)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("%s: link down: %v", what, err)
	}
}

// fencedWith waits until the target fenced c: its notice, with text
// holding want, then its connection closed.
func (c *attachClient) fencedWith(t *testing.T, want string) {
	t.Helper()
	select {
	case em := <-c.notices:
		if em.Code != protocol.CodeStale || !strings.Contains(em.Text, want) {
			t.Fatalf("notice %v %q, want CodeStale with %q", em.Code, em.Text, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no fence notice")
	}
	waitDown(t, c.Link, "a fenced session")
}

// exclusive serves an exclusive (not shared) export "vol" with opts.
func exclusive(t *testing.T, opts target.Options) *env {
	t.Helper()
	opts.CacheSize, opts.ChunkSize = 1<<20, 64<<10
	e, _ := startWith(t, make([]byte, 1<<20), opts, target.ExportConfig{})
	return e
}

// TestInstanceReinstatement: a read-write Open of a host ID is the same
// attach coming back (reinstated: the earlier session fenced) when it
// has the current session's instance, or none (an older initiator);
// another live attach of the host (another instance) is refused with
// ErrBusy and a text that names the live session and --takeover, and the
// holder goes on writing; with OpenTakeover it is fenced instead.
// Read-only Opens of other instances neither fence nor are refused.
// (Before instances, every Open of the host fenced the holder.)
func TestInstanceReinstatement(t *testing.T) {
	for _, c := range []struct {
		name          string
		first, second *protocol.Open
		fenced        string // the first's notice when fenced; "" refused
	}{
		{"same instance", rwOpen("host-a", 1, 0), rwOpen("host-a", 1, 0), `opened export "vol" again`},
		{"no instance: an older initiator", rwOpen("host-a", 1, 0), rwOpen("host-a", 0, 0), `opened export "vol" again`},
		{"neither has an instance", rwOpen("host-a", 0, 0), rwOpen("host-a", 0, 0), `opened export "vol" again`},
		{"another instance", rwOpen("host-a", 1, 0), rwOpen("host-a", 2, 0), ""},
		{"an instance where the holder has none", rwOpen("host-a", 0, 0), rwOpen("host-a", 2, 0), ""},
		{"another instance, takeover", rwOpen("host-a", 1, 0), rwOpen("host-a", 2, protocol.OpenTakeover), "(instance 0000000000000002) took export"},
		{"another instance, read-only", rwOpen("host-a", 1, 0),
			&protocol.Open{Mode: protocol.ModeReadOnly, Name: "vol", HostID: "host-a", Flags: protocol.OpenInstance, Instance: 2}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := exclusive(t, target.Options{})
			before := time.Now().Add(-time.Second) // the refusal's time is to the second
			first, err := e.attach(nil, c.first)
			if err != nil {
				t.Fatal(err)
			}
			first.works(t, 0, "first")
			after := time.Now()
			second, err := e.attach(nil, c.second)
			if c.fenced != "" {
				if err != nil {
					t.Fatalf("second open: %v", err)
				}
				first.fencedWith(t, c.fenced)
				second.works(t, 4096, "second")
				return
			}
			if c.second.Mode == protocol.ModeReadOnly {
				if err != nil {
					t.Fatalf("read-only open of another instance: %v", err)
				}
				first.works(t, 8192, "first, beside a read-only attach")
				return
			}
			if !errors.Is(err, protocol.ErrBusy) {
				t.Fatalf("second open: %v, want ErrBusy", err)
			}
			var re *protocol.RemoteError
			if !errors.As(err, &re) {
				t.Fatalf("second open: %T %v, want a RemoteError", err, err)
			}
			// The text names the live session: instance, peer address,
			// since when; and what to do.
			inst := "none"
			if c.first.Instance != 0 {
				inst = fmt.Sprintf("%016x", c.first.Instance)
			}
			for _, want := range []string{`another attach of host "host-a"`, "instance " + inst, "from " + first.Conn().LocalAddr(),
				"since ", "rblk-attach --takeover"} {
				if !strings.Contains(re.Text, want) {
					t.Errorf("refusal %q does not say %q", re.Text, want)
				}
			}
			_, rest, _ := strings.Cut(re.Text, "since ")
			stamp, _, _ := strings.Cut(rest, ";")
			if since, err := time.Parse(time.RFC3339, stamp); err != nil || since.Before(before) || since.After(after) {
				t.Errorf("refusal says since %q (%v), want a time between %v and %v", stamp, err, before, after)
			}
			// The holder goes on; the refused session holds nothing: no
			// handle, and its link still serves requests.
			first.works(t, 8192, "first, after a refused open")
			select {
			case em := <-first.notices:
				t.Fatalf("the holder got a notice: %v %q", em.Code, em.Text)
			default:
			}
			if err := second.Request(context.Background(), &protocol.GrantRequest{Handle: 1, Offset: 0}, &protocol.Grant{}); !errors.Is(err, protocol.ErrInvalid) {
				t.Fatalf("grant on the refused session: %v, want ErrInvalid (no handle)", err)
			}
			if err := second.Request(context.Background(), &protocol.ListExports{}, &protocol.ExportList{}); err != nil {
				t.Fatalf("the refused session: %v", err)
			}
		})
	}
}

// TestInstanceDeadHolderIsProbed: the holder's host hangs (its completions
// are held: it receives nothing and answers nothing, its connection up).
// Another attach of the host gets in without takeover once the target's
// liveness probe went unanswered, long before the target's keepalive
// would have dropped the holder; the holder is fenced (counted) and the
// newcomer holds the export (a third attach is refused: the newcomer
// answers).
func TestInstanceDeadHolderIsProbed(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	e, reg := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10,
		KeepAlive: 10 * time.Minute, LivenessProbe: 300 * time.Millisecond, Logger: zap.New(core)}, target.ExportConfig{})
	fp := faultnet.Wrap(e.p)
	first, err := e.attach(fp, rwOpen("host-a", 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	first.works(t, 0, "first")
	fp.Conns()[0].Delay(time.Hour) // the host hangs
	second, err := e.attach(nil, rwOpen("host-a", 2, 0))
	if err != nil {
		t.Fatalf("open of a successor while the holder hangs: %v", err)
	}
	second.works(t, 4096, "second")
	if n := counter(t, reg, "rblkd_sessions_fenced_total"); n != 1 {
		t.Fatalf("%v sessions fenced, want the hung holder", n)
	}
	if n := logs.FilterMessageSnippet("did not answer a liveness check").Len(); n != 1 {
		t.Fatalf("%d failed probes logged, want 1", n)
	}
	if _, err := e.attach(nil, rwOpen("host-a", 3, 0)); !errors.Is(err, protocol.ErrBusy) {
		t.Fatalf("a third attach: %v, want ErrBusy", err)
	}
	second.works(t, 8192, "second, after a third attach was refused")
}

// TestInstanceProbeOnceAtATime: while a probe of the holder is in flight
// (it hangs), other Opens of its identity wait for that probe instead of
// sending more, the target serves other sessions meanwhile, and the
// holder's link going down ends the wait at once: exactly one newcomer
// gets the export and the others are refused, naming it.
func TestInstanceProbeOnceAtATime(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10,
		KeepAlive: 10 * time.Minute, LivenessProbe: time.Minute, Logger: zap.New(core)}, target.ExportConfig{})
	fp := faultnet.Wrap(e.p)
	holder, err := e.attach(fp, rwOpen("host-a", 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	fp.Conns()[0].Delay(time.Hour)
	const n = 4
	type result struct {
		c   *attachClient
		err error
	}
	results := make(chan result, n)
	for i := range n {
		go func() {
			c, err := e.attach(nil, rwOpen("host-a", uint64(10+i), 0))
			results <- result{c, err}
		}()
	}
	waitLog(t, logs, "checking that this session lives", 1)
	// Another host's read-only session is served meanwhile.
	ro, err := e.attach(nil, &protocol.Open{Mode: protocol.ModeReadOnly, Name: "vol", HostID: "host-b"})
	if err != nil {
		t.Fatalf("another host's open during a probe: %v", err)
	}
	var g protocol.Grant
	if err := ro.Request(context.Background(), &protocol.GrantRequest{Handle: ro.info.Handle}, &g); err != nil {
		t.Fatalf("another host's grant during a probe: %v", err)
	}
	select {
	case r := <-results:
		t.Fatalf("an open returned during the probe: %v", r.err)
	default:
	}
	holder.Close() // the holder's link goes down: the probe fails at once
	var winners int
	for range n {
		select {
		case r := <-results:
			switch {
			case r.err == nil:
				winners++
				r.c.works(t, 0, "the successor")
			case !errors.Is(r.err, protocol.ErrBusy):
				t.Fatalf("open: %v, want success or ErrBusy", r.err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("opens still wait after the holder's link went down")
		}
	}
	if winners != 1 {
		t.Fatalf("%d successors got the export, want 1", winners)
	}
	if got := logs.FilterMessageSnippet("checking that this session lives").Len(); got > 2 {
		t.Fatalf("%d probes for %d opens: want the holder probed once, and the successor at most once", got, n)
	}
}

// waitLog waits until at least n lines holding snippet were logged.
func waitLog(t *testing.T, logs *observer.ObservedLogs, snippet string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for logs.FilterMessageSnippet(snippet).Len() < n {
		if time.Now().After(deadline) {
			t.Fatalf("no log %q", snippet)
		}
		time.Sleep(5 * time.Millisecond) // polling the log, bounded by the deadline
	}
}
