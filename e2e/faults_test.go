package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/faultproxy"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
)

// The fault tests of "Nothing lost, nothing hangs": real rblkd and
// rblk-attach processes, faults injected from outside them (kill -9,
// SIGTERM, a TCP proxy between them that resets, stalls or holds back
// bytes, a slow backing store under rblkd, a misbehaving initiator), and
// assertions on the bytes of the backing file and on time bounds.

// TestFaultSlowDiskFlushReachesFile checks the slow backing store the other
// tests use: a write to the FUSE file reaches the real file after the delay,
// fdatasync of the FUSE file reaches nbdkit as an NBD FLUSH (which its file
// plugin turns into fdatasync of the real file), and an NBD FLUSH through
// rblk-attach reaches it too.
func TestFaultSlowDiskFlushReachesFile(t *testing.T) {
	t.Parallel()
	disk := startSlowDisk(t, make([]byte, 1<<20), "50ms")

	f, err := os.OpenFile(disk.file, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, flushed0 := disk.logCounts(t, "Flush")
	start := time.Now()
	if _, err := f.WriteAt(blockData(2, 7), 2*blockSize); err != nil {
		t.Fatalf("write the FUSE file: %v", err)
	}
	if el := time.Since(start); el < 50*time.Millisecond {
		t.Errorf("a write of the FUSE file took %v, want at least the 50ms delay", el)
	}
	if err := syscall.Fdatasync(int(f.Fd())); err != nil {
		t.Fatalf("fdatasync the FUSE file: %v", err)
	}
	f.Close()
	if _, flushed := disk.logCounts(t, "Flush"); flushed <= flushed0 {
		t.Fatalf("fdatasync of the FUSE file: nbdkit logged %d successful flushes, %d before: it did not reach nbdkit", flushed, flushed0)
	}
	if got := blockID(2, disk.readReal(t)[2*blockSize:3*blockSize]); got != 7 {
		t.Fatalf("real file block 2 holds write %d, want 7", got)
	}

	// Through rblkd and rblk-attach: an NBD FLUSH is write-back plus
	// fdatasync of the FUSE file, so nbdkit sees a FLUSH after the write.
	tg := startTarget(t, []string{"vol=" + disk.file}, "--chunk-size", "64K")
	at := startAttach(t, tg, "vol")
	nc := dialNBD(t, at.sock, "vol")
	nc.mustWrite(t, 5*blockSize, blockData(5, 9))
	_, flushed1 := disk.logCounts(t, "Flush")
	// No lower bound on the FLUSH's time: rblkd's background write-back
	// may have written the block before the FLUSH came. What the FLUSH
	// must do is below: nbdkit sees a FLUSH, the real file holds the block.
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("NBD FLUSH: errno %d", errno)
	}
	if _, flushed := disk.logCounts(t, "Flush"); flushed <= flushed1 {
		t.Errorf("NBD FLUSH through rblk-attach: no FLUSH reached nbdkit (%d, %d before)", flushed, flushed1)
	}
	if got := blockID(5, disk.readReal(t)[5*blockSize:6*blockSize]); got != 9 {
		t.Errorf("after NBD FLUSH the real file's block 5 holds write %d, want 9", got)
	}
	nc.close()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// killWrite is one NBD write of a whole block in TestFaultKill9.
type killWrite struct {
	blk int
	id  uint32
}

// TestFaultKill9 kills rblkd with SIGKILL at seeded random points of a
// sequence of block writes and flushes made through rblk-attach, on the slow
// disk, and restarts it on the same port. Every write whose FLUSH returned
// OK before the kill must be in the real backing file right after the kill
// and after the restart (or a newer write of its block). The next FLUSH
// through the reattached volume must fail with EIO when writes acknowledged
// after the last OK flush were really lost, and must succeed when there
// were none. The first kill comes right after an OK FLUSH that met rblkd's
// background write-back of a write of the whole volume, with nothing
// written since (the case of the issue); each later one has a write, a
// FLUSH or nothing in flight.
func TestFaultKill9(t *testing.T) {
	t.Parallel()
	rng := faultSeed(t)
	const blocks = 128 // 512 KiB: 8 chunks of 64 KiB
	disk := startSlowDisk(t, make([]byte, blocks*blockSize), "30ms")
	exports := []string{"vol=" + disk.file}
	tg := startTarget(t, exports, "--chunk-size", "64K")
	at := startAttach(t, tg, "vol", "--reconnect-timeout", patient(90*time.Second).String(), "--queues", "3")
	nc := dialNBD(t, at.sock, "vol")

	acked := make([]uint32, blocks)   // the latest acknowledged write of each block
	durable := make([]uint32, blocks) // as of the last OK flush
	var since []killWrite             // acknowledged after the last OK flush
	next := uint32(1)
	write := func() {
		w := killWrite{blk: rng.IntN(blocks), id: next}
		next++
		nc.mustWrite(t, uint64(w.blk*blockSize), blockData(w.blk, w.id))
		acked[w.blk] = w.id
		since = append(since, w)
	}
	flushOK := func(when string) {
		if errno := nc.flush(t); errno != 0 {
			t.Fatalf("NBD FLUSH %s: errno %d", when, errno)
		}
		copy(durable, acked)
		since = nil
	}
	// checkFlushed fails t for every block of snap that lost a write whose
	// FLUSH returned OK: it must hold that write or a later one of its block.
	// Then, so that later rounds test something, the model takes the
	// disk's word for those blocks: the volume now reads what it has.
	checkFlushed := func(snap []byte, when string, inflight *killWrite) {
		t.Helper()
		bad := 0
		defer func() {
			if bad == 0 {
				return
			}
			for b := range blocks {
				got := blockID(b, snap[b*blockSize:(b+1)*blockSize])
				if got >= 0 && uint32(got) != durable[b] && !slices.ContainsFunc(since, func(w killWrite) bool { return w.blk == b }) &&
					(inflight == nil || inflight.blk != b) {
					durable[b], acked[b] = uint32(got), uint32(got)
				}
			}
		}()
		for b := range blocks {
			got := blockID(b, snap[b*blockSize:(b+1)*blockSize])
			ok := got == int64(durable[b])
			for _, w := range since {
				ok = ok || (w.blk == b && got == int64(w.id))
			}
			if inflight != nil && inflight.blk == b && got == int64(inflight.id) {
				ok = true
			}
			if !ok {
				bad++
				if bad <= 5 {
					t.Errorf("%s: block %d of the real file holds write %d, but write %d of it was flushed (FLUSH returned OK) and nothing newer can be there", when, b, got, durable[b])
				}
			}
		}
		if bad > 5 {
			t.Errorf("%s: %d blocks lost flushed writes in all", when, bad)
		}
	}

	for round := range 3 {
		ops := 5 + rng.IntN(30)
		for range ops {
			if rng.IntN(6) == 0 {
				flushOK(fmt.Sprintf("in round %d", round))
			} else {
				write()
			}
		}
		if round == 0 {
			// The case of the issue: a kill -9 right after FLUSH returned
			// OK, the FLUSH coming while rblkd's background write-back is
			// busy on the slow disk: one write of the whole volume (one
			// Done: every chunk dirty at once, so one write-back pass takes
			// them all), then the FLUSH once that pass reached the disk.
			// First nothing dirty and no write-back pass under way, so
			// that the pass the FLUSH meets is the one of this write.
			flushOK("before the write of the whole volume")
			disk.waitQuiet(t)
			started, _ := disk.logCounts(t, "Write")
			all := make([]byte, 0, blocks*blockSize)
			for b := range blocks {
				w := killWrite{blk: b, id: next}
				next++
				all = append(all, blockData(w.blk, w.id)...)
				acked[w.blk] = w.id
				since = append(since, w)
			}
			nc.mustWrite(t, 0, all)
			pollUntil(t, 30*time.Second, "rblkd's background write-back reaching the disk", func() bool {
				n, _ := disk.logCounts(t, "Write")
				return n > started
			})
			flushOK("right before the kill")
		}
		// A third of the later kills come with a write in flight, a third
		// with a FLUSH in flight.
		var inflight *killWrite
		flushInFlight := false
		if round > 0 {
			switch rng.IntN(3) {
			case 0:
				w := killWrite{blk: rng.IntN(blocks), id: next}
				next++
				if _, err := nc.send(nbdCmdWrite, uint64(w.blk*blockSize), blockData(w.blk, w.id)); err != nil {
					t.Fatal(err)
				}
				inflight = &w
			case 1:
				if _, err := nc.send(nbdCmdFlush, 0, nil); err != nil {
					t.Fatal(err)
				}
				flushInFlight = true
			}
		}
		t.Logf("round %d: kill -9 of rblkd after %d ops; %d writes acknowledged since the last OK flush; write in flight: %v; FLUSH in flight: %v",
			round, ops, len(since), inflight != nil, flushInFlight)
		tg.kill9(t)
		disk.waitQuiet(t)
		// Nothing writes the file until rblkd is back: this is what the
		// kill left on disk.
		snap := disk.readReal(t)
		checkFlushed(snap, fmt.Sprintf("round %d, right after kill -9", round), inflight)
		// Which writes acknowledged since the last OK flush are not on disk
		// (neither they nor a later write of their block)?
		var lost []killWrite
		for i, w := range since {
			got := blockID(w.blk, snap[w.blk*blockSize:(w.blk+1)*blockSize])
			here := got == int64(w.id)
			for _, later := range since[i+1:] {
				here = here || (later.blk == w.blk && got == int64(later.id))
			}
			if inflight != nil && inflight.blk == w.blk {
				here = true // superseded by the write redone after the restart
			}
			if !here {
				lost = append(lost, w)
			}
		}

		tg = startTargetOn(t, tg.addr, exports, "--chunk-size", "64K")
		var errno uint32
		first := "FLUSH after the restart"
		switch {
		case inflight != nil:
			h, e, err := nc.recv(90 * time.Second)
			if err != nil || e != 0 || h != nc.handle {
				t.Fatalf("round %d: the write in flight at the kill: handle %d (want %d), errno %d, %v", round, h, nc.handle, e, err)
			}
			errno = nc.flush(t)
		case flushInFlight:
			h, e, err := nc.recv(90 * time.Second)
			if err != nil || h != nc.handle {
				t.Fatalf("round %d: the FLUSH in flight at the kill: handle %d (want %d), %v", round, h, nc.handle, err)
			}
			errno = e
			first = "FLUSH in flight at the kill"
		default:
			errno = nc.flush(t)
		}
		checkFlushed(disk.readReal(t), fmt.Sprintf("round %d, after the restart", round), inflight)
		t.Logf("round %d: %s: errno %d; %d writes acknowledged since the last OK flush, %d of them not on disk", round, first, errno, len(since), len(lost))
		switch {
		case len(since) == 0 && errno != 0 && inflight == nil:
			// (With a write in flight at the kill, rblk-attach may have
			// acknowledged it before the kill, the reply unread here: it
			// may be lost with the killed target, and the EIO says so.
			// Its block is checked below.)
			t.Errorf("round %d: %s failed with errno %d, but no write was acknowledged since the last OK flush: nothing was lost", round, first, errno)
		case len(lost) > 0 && errno != nbdEIO:
			t.Errorf("round %d: %s returned errno %d, want EIO (%d): %d acknowledged writes were lost, first block %d write %d",
				round, first, errno, nbdEIO, len(lost), lost[0].blk, lost[0].id)
		}
		if errno != 0 {
			if e2 := nc.flush(t); e2 != 0 {
				t.Fatalf("round %d: the second FLUSH after the restart: errno %d, want OK", round, e2)
			}
		}
		// Lost writes are gone for good: their blocks hold what the disk has.
		for _, w := range lost {
			acked[w.blk] = uint32(max(0, blockID(w.blk, snap[w.blk*blockSize:(w.blk+1)*blockSize])))
		}
		if inflight != nil {
			acked[inflight.blk] = inflight.id
			if errno != 0 {
				// The write "in flight" may have been done and
				// acknowledged before the kill (its reply read only
				// now), and lost with the killed target's cache: the
				// EIO reports that, and the write is not redone. Its
				// block then holds what the disk had at the kill.
				b := inflight.blk
				atKill := blockID(b, snap[b*blockSize:(b+1)*blockSize])
				if now := blockID(b, disk.readReal(t)[b*blockSize:(b+1)*blockSize]); now != int64(inflight.id) && now == atKill {
					t.Logf("round %d: the write in flight at the kill was acknowledged before it and lost (reported by the EIO)", round)
					acked[b] = uint32(max(0, atKill))
				}
			}
		}
		copy(durable, acked)
		since = nil
		checkFlushed(disk.readReal(t), fmt.Sprintf("round %d, after FLUSH OK on the restarted target", round), nil)
	}
	nc.close()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	checkFlushed(disk.readReal(t), "after both stopped", nil)
}

// TestFaultSIGTERMRestart restarts rblkd with SIGTERM while much written
// data is not flushed and the disk is slow. A planned restart loses nothing
// and reports nothing: rblkd writes everything back and exits 0, and after
// the restart the initiator's next FLUSH succeeds and the data is intact.
func TestFaultSIGTERMRestart(t *testing.T) {
	t.Parallel()
	const size = 16 << 20
	disk := startSlowDisk(t, make([]byte, size), "1000ms")
	exports := []string{"vol=" + disk.file}
	tg := startTarget(t, exports)
	at := startAttach(t, tg, "vol", "--reconnect-timeout", patient(90*time.Second).String(), "--queues", "3")
	nc := dialNBD(t, at.sock, "vol")
	want := randomBytes(11, size)
	// Read everything first: the chunks are then cached, and the writes
	// below are all in rblkd's memory long before the slow disk has them.
	nc.readAll(t)
	start := time.Now()
	for off := 0; off < size; off += 256 << 10 {
		nc.mustWrite(t, uint64(off), want[off:off+256<<10])
	}
	t.Logf("wrote %d MiB without FLUSH in %v; SIGTERM to rblkd", size>>20, time.Since(start).Round(time.Millisecond))
	start = time.Now()
	tg.stop(t, 3*time.Minute)
	t.Logf("rblkd drained and exited 0 in %v", time.Since(start).Round(time.Millisecond))
	disk.waitQuiet(t)
	if d := firstDiff(disk.readReal(t), want); d != "" {
		t.Errorf("real backing file after rblkd's SIGTERM exit: %s", d)
	}

	tg = startTargetOn(t, tg.addr, exports)
	waitMetric(t, at.metrics, "rblk_attach_target_sessions", func(v float64) bool { return v == 1 }, "1 (reconnected)")
	if errno := nc.flush(t); errno != 0 {
		t.Errorf("first FLUSH after a SIGTERM restart of rblkd: errno %d, want OK: nothing was lost", errno)
	}
	if d := firstDiff(nc.readAll(t), want); d != "" {
		t.Errorf("volume read after the restart: %s", d)
	}
	if errno := nc.flush(t); errno != 0 {
		t.Errorf("second FLUSH after the restart: errno %d", errno)
	}
	nc.close()
	at.stop(t, stopTimeout)
	tg.stop(t, 3*time.Minute)
	if d := firstDiff(disk.readReal(t), want); d != "" {
		t.Errorf("real backing file at the end: %s", d)
	}
}

// fioRun is a fio run started in the background.
type fioRun struct {
	args []string
	done chan struct{}
	r    result
	err  error
}

// startFio runs fio with args (plus JSON output) in the background.
func startFio(t *testing.T, args ...string) *fioRun {
	t.Helper()
	needTools(t, "fio")
	path, _ := toolPath("fio")
	f := &fioRun{args: append([]string{"--output-format=json"}, args...), done: make(chan struct{})}
	ctx, cancel := context.WithTimeout(context.Background(), patient(4*time.Minute))
	cmd := exec.CommandContext(ctx, path, f.args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("start fio: %v", err)
	}
	t.Logf("started fio %s", strings.Join(f.args, " "))
	go func() {
		defer close(f.done)
		defer cancel()
		err := cmd.Wait()
		f.r = result{stdout: stdout.String(), stderr: stderr.String()}
		var ee *exec.ExitError
		switch {
		case ctx.Err() != nil:
			f.err = fmt.Errorf("fio timed out: %w", ctx.Err())
		case errors.As(err, &ee):
			f.r.code = ee.ExitCode()
		case err != nil:
			f.err = err
		}
	}()
	t.Cleanup(func() { cancel(); <-f.done })
	return f
}

func (f *fioRun) exited() bool {
	select {
	case <-f.done:
		return true
	default:
		return false
	}
}

// wait waits for fio and fails t unless it passed without verify errors.
func (f *fioRun) wait(t *testing.T) fioResult {
	t.Helper()
	<-f.done
	if f.err != nil {
		t.Fatalf("fio %s: %v\n%s", strings.Join(f.args, " "), f.err, f.r)
	}
	return checkFio(t, f.r)
}

// checkFio parses fio's JSON output and fails t on any error.
func checkFio(t *testing.T, r result) fioResult {
	t.Helper()
	if r.code != 0 {
		t.Fatalf("fio failed: %s", r)
	}
	out := r.stdout
	if i := strings.Index(out, "{"); i >= 0 {
		out = out[i:]
	}
	var res fioResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("fio JSON: %v\n%s", err, r)
	}
	if len(res.Jobs) == 0 {
		t.Fatalf("fio JSON has no job: %s", r)
	}
	for _, j := range res.Jobs {
		if j.Error != 0 {
			t.Fatalf("fio job %s: error %d\n%s", j.Name, j.Error, r)
		}
	}
	for _, s := range []string{r.stderr, r.stdout} {
		if strings.Contains(s, "verify:") || strings.Contains(s, "bad magic") || strings.Contains(s, "crc32c") && strings.Contains(s, "wanted") {
			t.Fatalf("fio reports verify errors:\n%s", r)
		}
	}
	return res
}

// verifyFile checks with fio's verify_only that file holds what a fio job
// with the same job options wrote: every block's header and crc32c.
func verifyFile(t *testing.T, file string, job ...string) {
	t.Helper()
	args := append([]string{"--name=rblk", "--filename=" + file, "--ioengine=psync", "--verify_only",
		"--verify_fatal=1", "--verify_state_load=0", "--output-format=json"}, job...)
	r := run(t, 4*time.Minute, "fio", args...)
	res := checkFio(t, r)
	if res.Jobs[0].Read.IOBytes == 0 {
		t.Fatalf("fio --verify_only read nothing of %s: %s", file, r)
	}
}

// silenceTarget is a link fault over rdma: once rblkd has taken after more
// bytes of writes (or fio ended: false), rblkd is stopped with SIGSTOP
// until at's keepalive declares the link dead (its rblk_attach_target_sessions
// drops to 0), then resumed; it returns once at has reconnected.
func silenceTarget(t *testing.T, tg *target, at *attacher, fio *fioRun, after int64) bool {
	t.Helper()
	w0 := metric(t, tg.metrics, "rblkd_written_bytes_total")
	pollUntil(t, 60*time.Second, fmt.Sprintf("rblkd taking %d more bytes of writes", after), func() bool {
		v, _ := metricSum(scrapeQuiet(tg.metrics), "rblkd_written_bytes_total")
		return v >= w0+float64(after) || fio.exited()
	})
	if fio.exited() {
		return false
	}
	r0 := metric(t, at.metrics, "rblk_attach_reconnects_total")
	if err := tg.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP rblkd: %v", err)
	}
	start := time.Now()
	var down bool
	func() {
		// (resumed whatever happens: a stopped rblkd takes no SIGTERM)
		defer tg.cmd.Process.Signal(syscall.SIGCONT)
		down = waitUntil(at.proc, 60*time.Second, func() bool {
			v, ok := metricSum(scrapeQuiet(at.metrics), "rblk_attach_target_sessions")
			return ok && v == 0
		}) == nil
	}()
	if !down {
		t.Fatalf("rblkd silent (SIGSTOP) for %v: rblk-attach did not declare the link dead\n%s", time.Since(start).Round(time.Millisecond), at.out.String())
	}
	t.Logf("rblkd silent for %v after %d more bytes: rblk-attach declared the link dead; rblkd resumed", time.Since(start).Round(time.Millisecond), after)
	if err := waitUntil(at.proc, 60*time.Second, func() bool {
		v, _ := metricSum(scrapeQuiet(at.metrics), "rblk_attach_reconnects_total")
		return v > r0
	}); err != nil {
		t.Fatalf("rblk-attach did not reconnect to the resumed rblkd: %v", err)
	}
	return true
}

// viaProxy is the target as rblk-attach sees it through the proxy.
func viaProxy(tg *target, px *faultproxy.Proxy) *target {
	return &target{proc: tg.proc, addr: px.Addr(), metrics: tg.metrics}
}

// TestFaultLinkReset resets the connection between rblk-attach and rblkd
// (TCP RST both ways, through the proxy) at seeded random points while fio
// writes with crc32c verification through rblk-attach: rblk-attach
// reconnects and redoes the IO, fio's verification passes, and the backing
// file holds what fio wrote. Over rdma, where no proxy can sit in the path,
// the fault is a silent target instead: rblkd stopped (SIGSTOP) until
// rblk-attach's keepalive (2 s) declared the link dead, then resumed; the
// same rblkd process comes back, so nothing acknowledged may be lost.
func TestFaultLinkReset(t *testing.T) {
	t.Parallel()
	needTools(t, "fio")
	rng := faultSeed(t)
	backing := filepath.Join(t.TempDir(), "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=32M"})
	job := []string{"--rw=randwrite", "--bs=16k", "--size=32M", "--verify=crc32c"}
	var at *attacher
	var fio *fioRun
	// inject waits for the moment of fault i and injects it; false: fio
	// ended first.
	var inject func(i int) bool
	if e2e.transport == "tcp" {
		px := startProxy(t, tg.addr)
		at = startAttach(t, viaProxy(tg, px), "vol", append(newFlags("--host-id", "e2e-link-reset"), "--reconnect-timeout", patient(60*time.Second).String())...)
		inject = func(i int) bool {
			c, err := px.WaitConn(ctxFor(t, 60*time.Second), i)
			if err != nil {
				t.Fatal(err)
			}
			after := int64(512<<10 + rng.IntN(4<<20))
			ctx, cancel := context.WithTimeout(context.Background(), patient(60*time.Second))
			err = c.WaitFor(ctx, func(s faultproxy.Stats) bool {
				return s.Received[faultproxy.ClientToServer] >= after || fio.exited()
			})
			cancel()
			if fio.exited() {
				return false
			}
			if err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			c.Reset()
			t.Logf("reset connection %d after %d bytes from rblk-attach", i, after)
			return true
		}
	} else {
		at = startAttach(t, tg, "vol", append(newFlags("--host-id", "e2e-link-reset", "--keepalive-timeout", "2s"), "--reconnect-timeout", patient(60*time.Second).String())...)
		inject = func(i int) bool { return silenceTarget(t, tg, at, fio, int64(512<<10+rng.IntN(4<<20))) }
	}
	fio = startFio(t, append(append([]string{"--name=rblk"}, fioTarget(at.uri("vol"))...), append([]string{"--iodepth=16",
		"--do_verify=1", "--verify_fatal=1", "--exitall_on_error=1", "--verify_state_save=0"}, job...)...)...)

	resets := 0
	for i := range 5 {
		if !inject(i) {
			break
		}
		resets++
	}
	res := fio.wait(t)
	if resets == 0 {
		t.Fatalf("fio finished before the first reset: no fault was injected")
	}
	if j := res.Jobs[0]; j.Write.IOBytes != 32<<20 || j.Read.IOBytes < 32<<20 {
		t.Errorf("fio wrote %d and verified %d bytes, want %d both", j.Write.IOBytes, j.Read.IOBytes, 32<<20)
	}
	if v := metric(t, at.metrics, "rblk_attach_reconnects_total"); v < float64(resets) {
		t.Errorf("rblk_attach_reconnects_total = %v after %d resets", v, resets)
	}
	nc := dialNBD(t, at.sock, "vol")
	if errno := nc.flush(t); errno != 0 {
		// Writes acknowledged before a reset but not flushed may be
		// reported lost; the next FLUSH must succeed.
		t.Logf("first FLUSH after the resets: errno %d", errno)
		if errno := nc.flush(t); errno != 0 {
			t.Fatalf("second FLUSH after the resets: errno %d", errno)
		}
	}
	nc.close()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	t.Logf("checking that the backing file holds every block fio wrote and verified through the volume")
	verifyFile(t, backing, job...)
}

// TestFaultLinkResetLosesDone is the deterministic form of the loss
// TestFaultLinkReset finds at random: the connection is reset right after
// an RDMA WRITE was executed and acknowledged, while the Done that follows
// it is on its way. The proxy holds back rblkd's acknowledgement until the
// WRITE frame was delivered, then holds back rblk-attach's next frame (the
// Done) and resets the link. The write was acknowledged to the NBD client
// and rblkd, alive, has the data: nothing may be lost. After a FLUSH (EIO
// is tolerated once, then it must succeed) the backing file must hold it.
func TestFaultLinkResetLosesDone(t *testing.T) {
	t.Parallel()
	onlyTransport(t, "tcp", "the proxy holds back one direction of one connection between two frames; nothing outside the processes can do that to an RDMA path (the verbs provider's failpoints inject DISCONNECTED in the middle of IO instead)")
	const blk = 9
	off := uint64(blk * blockSize)
	backing, tg, px, at, nc := proxiedBlock(t, "e2e-lost-done", blk)
	c, err := px.WaitConn(ctxFor(t, 10*time.Second), 0)
	if err != nil {
		t.Fatal(err)
	}
	c.HoldBack(faultproxy.ServerToClient)
	c.HoldBack(faultproxy.ClientToServer)
	if _, err := nc.send(nbdCmdWrite, off, blockData(blk, 2)); err != nil {
		t.Fatal(err)
	}
	// The RDMA WRITE frame: 32 bytes of header and the block.
	if err := c.WaitFor(ctxFor(t, 10*time.Second), faultproxy.HeldAtLeast(faultproxy.ClientToServer, 32+blockSize)); err != nil {
		t.Fatalf("the RDMA WRITE did not leave rblk-attach: %v", err)
	}
	if _, err := c.Release(faultproxy.ClientToServer); err != nil {
		t.Fatal(err)
	}
	c.HoldBack(faultproxy.ClientToServer)
	// rblkd executes it and acknowledges: let the ACK through, and catch
	// what rblk-attach sends next, the Done (a SEND frame of at least 32 +
	// 24 bytes).
	if err := c.WaitFor(ctxFor(t, 10*time.Second), faultproxy.HeldAtLeast(faultproxy.ServerToClient, 32)); err != nil {
		t.Fatalf("rblkd did not acknowledge the RDMA WRITE: %v", err)
	}
	if _, err := c.Release(faultproxy.ServerToClient); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitFor(ctxFor(t, 10*time.Second), faultproxy.HeldAtLeast(faultproxy.ClientToServer, 32+protocol.HeaderSize)); err != nil {
		t.Fatalf("rblk-attach sent nothing after the acknowledgement of its WRITE: %v", err)
	}
	c.Reset()
	_, errno, err := nc.recv(60 * time.Second)
	if err != nil || errno != 0 {
		t.Fatalf("the write whose Done was lost: errno %d, %v", errno, err)
	}
	if id := blockID(blk, nc.mustRead(t, off, blockSize)); id != 2 {
		t.Errorf("the volume reads write %d of block %d after the reset, want 2 (acknowledged)", id, blk)
	}
	first := nc.flush(t)
	if first != 0 {
		t.Logf("first FLUSH after the reset: errno %d; again", first)
		if errno := nc.flush(t); errno != 0 {
			t.Fatalf("second FLUSH after the reset: errno %d", errno)
		}
	}
	got, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if id := blockID(blk, got[off:off+blockSize]); id != 2 {
		t.Errorf("backing file block %d holds write %d after FLUSH, want 2: a write acknowledged before a link reset was lost (first FLUSH: errno %d), though rblkd never went away", blk, id, first)
	}
	nc.close()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	got, err = os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if id := blockID(blk, got[off:off+blockSize]); id != 2 {
		t.Errorf("backing file block %d holds write %d at the end, want 2", blk, id)
	}
}

// TestFaultLinkStall makes the links between two rblk-attach processes and
// rblkd silent (the proxy stops forwarding and keeps the sockets open;
// connections made later are stalled too; over rdma rblkd is stopped with
// SIGSTOP: see faultLink). Both run with
// --keepalive-timeout 2s and --reconnect-timeout 3s. On the first a read
// must fail with EIO within 15 s, never hang. The second, with unflushed
// writes, gets SIGTERM as the link stalls: it must exit within 15 s.
func TestFaultLinkStall(t *testing.T) {
	t.Parallel()
	backing := filepath.Join(t.TempDir(), "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=4M,shared"}, "--chunk-size", "64K")
	link := startFaultLink(t, tg)
	flags := append(newFlags("--keepalive-timeout", "2s"), "--reconnect-timeout", "3s")
	reader := startAttach(t, link.target(), "vol", flags...)
	quitter := startAttach(t, link.target(), "vol", flags...)
	nc := dialNBD(t, reader.sock, "vol")
	data := randomBytes(5, 64<<10)
	nc.mustWrite(t, 0, data)
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("FLUSH before the stall: errno %d", errno)
	}
	if got := nc.mustRead(t, 0, len(data)); !bytes.Equal(got, data) {
		t.Fatalf("read before the stall: %s", firstDiff(got, data))
	}
	nq := dialNBD(t, quitter.sock, "vol")
	nq.mustWrite(t, 1<<20, data) // not flushed
	nq.close()

	link.stallAll(t)
	t.Logf("links stalled")
	if err := quitter.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM rblk-attach: %v", err)
	}
	start := time.Now()
	// Over rdma a chunk the reader holds a grant of is read by an RDMA
	// READ, which the RDMA device serves without rblkd running: a stopped
	// rblkd is a dead link only for what needs rblkd. So there the read is
	// of a chunk the reader holds no grant of (3 MiB): it needs rblkd.
	readAt := uint64(4096)
	if e2e.transport == "rdma" {
		readAt = 3 << 20
	}
	if _, err := nc.sendLen(nbdCmdRead, readAt, 4096, nil); err != nil {
		t.Fatal(err)
	}
	// The reply's header; a successful read's data would follow.
	_, errno, err := nc.recv(15 * time.Second)
	el := time.Since(start)
	switch {
	case err != nil:
		t.Errorf("a read on a stalled link got no reply within %v (%v): it hangs", el.Round(time.Millisecond), err)
	case errno == 0:
		t.Errorf("a read on a stalled link succeeded after %v, want EIO", el)
	case errno != nbdEIO:
		t.Errorf("a read on a stalled link failed with errno %d after %v, want EIO", errno, el)
	default:
		t.Logf("a read on the stalled link failed with EIO after %v", el.Round(time.Millisecond))
	}

	// SIGTERM while the link is stalled: the process must end within the
	// bound, whatever its exit code (its unflushed writes cannot be made
	// durable).
	select {
	case <-quitter.done:
		t.Logf("rblk-attach exited (%v) %v after SIGTERM on a stalled link", quitter.waitErr, time.Since(start).Round(time.Millisecond))
		quitter.checkOutput(t)
	case <-time.After(15*time.Second - time.Since(start)):
		t.Errorf("rblk-attach did not exit within 15s of SIGTERM with the link stalled")
	}
	link.resumeAll(t)
	tg.stop(t, stopTimeout)
}

// TestFaultLateFrames delivers the frames of a dead connection late: the
// bytes rblk-attach sends on the connection that carries a write are held
// back, the client side of that connection is reset (rblkd's side stays
// open) so that rblk-attach, with --host-id, reconnects and redoes the
// write; newer data is then written to the same block and flushed, and only
// then are the held bytes delivered to rblkd. The newer data must win: in
// what the volume reads and in the backing file.
func TestFaultLateFrames(t *testing.T) {
	t.Parallel()
	onlyTransport(t, "tcp", "late frames of a dead connection are bytes a TCP proxy held back and delivers after the reconnection; an RDMA queue pair in the error state delivers nothing late")
	const blk = 5
	off := uint64(blk * blockSize)
	backing, tg, px, at, nc := proxiedBlock(t, "e2e-late-frames", blk)
	old, err := px.WaitConn(ctxFor(t, 10*time.Second), 0)
	if err != nil {
		t.Fatal(err)
	}

	// The write of version 2 leaves rblk-attach, and is held back.
	old.HoldBack(faultproxy.ClientToServer)
	nc2 := dialNBD(t, at.sock, "vol")
	if _, err := nc2.send(nbdCmdWrite, off, blockData(blk, 2)); err != nil {
		t.Fatal(err)
	}
	if err := old.WaitFor(ctxFor(t, 10*time.Second), faultproxy.HeldAtLeast(faultproxy.ClientToServer, blockSize)); err != nil {
		t.Fatalf("the write did not leave rblk-attach: %v", err)
	}
	old.ResetClientSideOnly()
	if _, errno, err := nc2.recv(60 * time.Second); err != nil || errno != 0 {
		t.Fatalf("write of version 2, redone after the reconnection: errno %d, %v", errno, err)
	}
	if px.Accepted() < 2 {
		t.Fatalf("the write completed without a new connection (%d accepted)", px.Accepted())
	}

	// Version 3, newer, is written and flushed.
	nc.mustWrite(t, off, blockData(blk, 3))
	errno := nc.flush(t)
	if errno != 0 {
		t.Logf("FLUSH after the reconnection: errno %d; again", errno)
		if errno = nc.flush(t); errno != 0 {
			t.Fatalf("second FLUSH after the reconnection: errno %d", errno)
		}
	}
	got, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if id := blockID(blk, got[off:off+blockSize]); id != 3 {
		t.Fatalf("backing file block %d holds write %d after FLUSH, want 3", blk, id)
	}

	// The late frames of the dead connection reach rblkd. Wait until rblkd
	// answered them on that connection (an ACK or NAK frame) or closed it.
	before := old.Stats()
	n, rerr := old.Release(faultproxy.ClientToServer)
	t.Logf("released %d bytes held back from the dead connection (%v); server side closed before: %v", n, rerr, before.ServerClosed)
	if err := old.WaitFor(ctxFor(t, 15*time.Second), func(s faultproxy.Stats) bool {
		return s.ServerClosed || s.Received[faultproxy.ServerToClient] >= before.Received[faultproxy.ServerToClient]+32
	}); err != nil {
		t.Fatalf("rblkd neither answered nor closed the dead connection after its late frames: %v", err)
	}
	if id := blockID(blk, nc.mustRead(t, off, blockSize)); id != 3 {
		t.Errorf("after the late frames of the dead connection the volume reads write %d of block %d, want 3: old data overwrote newer data", id, blk)
	}
	if errno := nc.flush(t); errno != 0 {
		t.Errorf("FLUSH after the late frames: errno %d", errno)
	}
	nc2.close()
	nc.close()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	got, err = os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if id := blockID(blk, got[off:off+blockSize]); id != 3 {
		t.Errorf("backing file block %d holds write %d at the end, want 3", blk, id)
	}
}

// grantHog is a misbehaving initiator: it opens the volume read-write,
// takes write grants of chunks and never answers a Revoke. When rblkd
// drops its session it connects again and takes them again.
type grantHog struct {
	wg       sync.WaitGroup
	cancel   context.CancelFunc
	mu       sync.Mutex
	sessions int   // sessions that took every grant
	lastErr  error // why the last session ended or failed
	holding  chan struct{}
}

// startGrantHog starts a grant hog of export at addr over the run's
// transport (testProvider).
func startGrantHog(t *testing.T, addr, export string, chunkSize, chunks int) *grantHog {
	t.Helper()
	p := testProvider(t)
	ctx, cancel := context.WithCancel(context.Background())
	h := &grantHog{cancel: cancel, holding: make(chan struct{})}
	h.wg.Add(1)
	go h.run(ctx, p, addr, export, chunkSize, chunks)
	t.Cleanup(h.stop)
	select {
	case <-h.holding:
	case <-time.After(patient(30 * time.Second)):
		t.Fatalf("grant hog: no grants within 30s: %v", h.err())
	}
	return h
}

func (h *grantHog) err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lastErr
}

func (h *grantHog) stop() {
	h.cancel()
	h.wg.Wait()
}

func (h *grantHog) run(ctx context.Context, p transport.Provider, addr, export string, chunkSize, chunks int) {
	defer h.wg.Done()
	for ctx.Err() == nil {
		err := h.session(ctx, p, addr, export, chunkSize, chunks)
		h.mu.Lock()
		h.lastErr = err
		h.mu.Unlock()
		if ctx.Err() == nil {
			// Not too hot a loop if rblkd refuses it outright.
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

func (h *grantHog) session(ctx context.Context, p transport.Provider, addr, export string, chunkSize, chunks int) error {
	// Revokes are never answered. Any other request of rblkd (a keepalive,
	// where the protocol has one) gets OK: the hog is alive, only greedy.
	var lp atomic.Pointer[link.Link]
	var replies sync.WaitGroup
	handler := func(h protocol.Header, _ []byte) {
		if h.Type == protocol.TypeRevoke || h.Tag == 0 {
			return
		}
		if l := lp.Load(); l != nil {
			replies.Add(1)
			go func() { // a Handler must not block: send from a goroutine
				defer replies.Done()
				l.Send(ctx, h.Tag, &protocol.OK{})
			}()
		}
	}
	l, err := link.Dial(ctx, p, addr, link.Options{Handler: handler})
	if err != nil {
		return fmt.Errorf("grant hog: dial: %w", err)
	}
	lp.Store(l)
	defer replies.Wait()
	defer l.Close()
	if _, err := auth.Initiate(ctx, l, "grant-hog", nil); err != nil {
		return fmt.Errorf("grant hog: %w", err)
	}
	var info protocol.VolumeInfo
	if err := l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadWrite, Name: export}, &info); err != nil {
		return fmt.Errorf("grant hog: open: %w", err)
	}
	for i := range chunks {
		var g protocol.Grant
		req := protocol.GrantRequest{Handle: info.Handle, Flags: protocol.GrantWrite, Offset: uint64(i * chunkSize)}
		if err := l.Request(ctx, &req, &g); err != nil {
			return fmt.Errorf("grant hog: grant of chunk %d: %w", i, err)
		}
	}
	h.mu.Lock()
	h.sessions++
	if h.sessions == 1 {
		close(h.holding)
	}
	h.mu.Unlock()
	select {
	case <-l.Done():
		return fmt.Errorf("grant hog: session ended: %w", l.Err())
	case <-ctx.Done():
		return nil
	}
}

// TestFaultGrantHog runs a grant hog beside a well-behaved rblk-attach: the
// hog holds write grants of as many chunks as rblkd's cache has and never
// answers a Revoke (and comes back when dropped). Every holder has the whole
// revoke timeout (2 s here) to answer, so the normal initiator's first read
// of another chunk may wait that long, once: the hog is then dropped, and
// when it comes back (its share cut) it cannot take the cache again. Each
// read must stay within a revoke timeout and a second (the second
// stretched under emulation: RBLK_E2E_TIME_SCALE), all eight within two
// of that, and return the right data.
func TestFaultGrantHog(t *testing.T) {
	t.Parallel()
	const size, chunk = 2 << 20, 64 << 10
	backing := filepath.Join(t.TempDir(), "vol.img")
	initial := randomBytes(21, size)
	if err := os.WriteFile(backing, initial, 0o600); err != nil {
		t.Fatal(err)
	}
	const revokeTimeout = 2 * time.Second
	tg := startTarget(t, []string{"vol=" + backing + ",shared"}, "--chunk-size", "64K", "--cache-size", "256K",
		"--revoke-timeout", revokeTimeout.String())
	hog := startGrantHog(t, tg.addr, "vol", chunk, 4)
	at := startAttach(t, tg, "vol")
	nc := dialNBD(t, at.sock, "vol")
	// A read's own time beside the revoke timeout: a second, stretched
	// under emulation. Were the hog to take the cache back, each read would
	// wait a revoke timeout: 16 s for the eight, beyond 2*bound even
	// stretched 4 times (12 s).
	bound := revokeTimeout + patient(time.Second)
	var worst, total time.Duration
	for i := range 8 {
		off := (16 + i) * chunk
		start := time.Now()
		errno, got, err := nc.do(nbdCmdRead, uint64(off), chunk, nil)
		el := time.Since(start)
		worst = max(worst, el)
		total += el
		if err != nil || errno != 0 {
			t.Fatalf("read %d of chunk %d beside the grant hog: errno %d, %v after %v", i, 16+i, errno, err, el)
		}
		if d := firstDiff(got, initial[off:off+chunk]); d != "" {
			t.Fatalf("read of chunk %d: %s", 16+i, d)
		}
		if el > bound {
			t.Fatalf("read %d of chunk %d took %v beside a grant hog holding the whole cache, want under %v (revoke timeout %v)",
				i, 16+i, el.Round(time.Millisecond), bound, revokeTimeout)
		}
	}
	if total > 2*bound {
		t.Fatalf("8 reads took %v beside a grant hog, want under %v: the hog took the cache back", total.Round(time.Millisecond), 2*bound)
	}
	hog.mu.Lock()
	sessions, herr := hog.sessions, hog.lastErr
	hog.mu.Unlock()
	t.Logf("8 reads beside the grant hog: %v in all, slowest %v; the hog took its grants in %d sessions (last: %v)",
		total.Round(time.Millisecond), worst.Round(time.Millisecond), sessions, herr)
	hog.stop()
	nc.close()
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	got, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if d := firstDiff(got, initial); d != "" {
		t.Errorf("backing file after the grant hog (which wrote nothing): %s", d)
	}
}

// TestFaultBigWritesSmallChunks writes 1 MiB blocks at queue depth 32 from
// four fio jobs (up to 64 MiB in flight, rblk-attach's buffer pool) with
// --chunk-size 64K, so each write is a chain of 16 RDMA WRITEs and a Done,
// over a link whose acknowledgements take 5 ms (the proxy delays
// rblkd->rblk-attach), and flushes: the send queue must not overflow and
// drop the link (no reconnection, no "link down" in rblk-attach's log), and
// the backing file must hold what fio wrote.
func TestFaultBigWritesSmallChunks(t *testing.T) {
	t.Parallel()
	needTools(t, "fio")
	backing := filepath.Join(t.TempDir(), "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=64M"}, "--chunk-size", "64K")
	link := startFaultLink(t, tg)
	link.delayAll(t, faultproxy.ServerToClient, 50*time.Millisecond)
	at := startAttach(t, link.target(), "vol", "--reconnect-timeout", patient(60*time.Second).String())
	// Four jobs (four NBD connections) of queue depth 32, each on its own
	// 16 MiB. Two passes: in the second every chunk is granted, and each
	// write goes out as one chain.
	// Writes start 4 KiB into a chunk: each spans 17 chunks and 4 buffer
	// slots, 20 RDMA WRITEs.
	job := []string{"--rw=write", "--bs=1M", "--size=7M", "--numjobs=8", "--offset=4k", "--offset_increment=8M", "--verify=crc32c"}
	fio := startFio(t, append(append([]string{"--name=rblk"}, fioTarget(at.uri("vol"))...), append([]string{"--iodepth=32",
		"--loops=4", "--do_verify=0", "--end_fsync=1", "--exitall_on_error=1", "--verify_state_save=0"}, job...)...)...)
	// How deep the queue really got (sampled).
	var deepest float64
	for !fio.exited() {
		if v, ok := metricSum(scrapeQuiet(at.metrics), "rblk_attach_nbd_requests_in_flight"); ok {
			deepest = max(deepest, v)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("up to %v NBD requests in flight in rblk-attach (sampled every 20 ms)", deepest)
	res := fio.wait(t)
	for _, j := range res.Jobs {
		if j.Write.IOBytes != 4*7<<20 {
			t.Errorf("fio job wrote %d bytes, want %d", j.Write.IOBytes, 4*7<<20)
		}
	}
	m := scrape(t, at.metrics)
	ops, _ := metricSum(m, "rblk_attach_rdma_ops_total", `op="write"`)
	grants, _ := metricSum(m, "rblk_attach_grant_requests_total")
	t.Logf("rblk-attach: %v RDMA WRITEs, %v grant requests", ops, grants)
	nc := dialNBD(t, at.sock, "vol")
	if errno := nc.flush(t); errno != 0 {
		t.Errorf("FLUSH after fio: errno %d", errno)
	}
	nc.close()
	if v := metric(t, at.metrics, "rblk_attach_reconnects_total"); v != 0 {
		t.Errorf("rblk_attach_reconnects_total = %v after 1 MiB writes at QD 32 with 64K chunks, want 0", v)
	}
	for _, bad := range []string{"link down", "connection to the target lost"} {
		if i := strings.Index(at.out.String(), bad); i >= 0 {
			line := at.out.String()[i:]
			if j := strings.IndexByte(line, '\n'); j >= 0 {
				line = line[:j]
			}
			t.Errorf("rblk-attach's log has %q: %s", bad, line)
		}
	}
	at.stop(t, stopTimeout)
	// The detach's Close gives up every grant the attach holds (a
	// thousand here: 64 MiB of 64K chunks), each a memory window
	// invalidated over rdma.
	m = scrape(t, tg.metrics)
	closeSum, _ := metricSum(m, "rblkd_request_duration_seconds_sum", `op="close"`)
	closes, _ := metricSum(m, "rblkd_request_duration_seconds_count", `op="close"`)
	t.Logf("rblkd: %v Close request(s) served in %.3fs in all", closes, closeSum)
	tg.stop(t, stopTimeout)
	verifyFile(t, backing, job...)
}

// proxiedBlock starts rblkd on a 1 MiB volume of 64K chunks and rblk-attach
// with hostID through a fault proxy, writes version 1 of block blk through
// an NBD client and flushes it: the attach then holds a write grant of the
// block's chunk.
func proxiedBlock(t *testing.T, hostID string, blk int) (string, *target, *faultproxy.Proxy, *attacher, *nbdClient) {
	t.Helper()
	backing := filepath.Join(t.TempDir(), "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=1M"}, "--chunk-size", "64K")
	px := startProxy(t, tg.addr)
	at := startAttach(t, viaProxy(tg, px), "vol", append(newFlags("--host-id", hostID), "--reconnect-timeout", "30s")...)
	nc := dialNBD(t, at.sock, "vol")
	nc.mustWrite(t, uint64(blk*blockSize), blockData(blk, 1))
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("first FLUSH: errno %d", errno)
	}
	return backing, tg, px, at, nc
}
