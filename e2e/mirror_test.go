package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/rblk/rblk/csidriver"
	"github.com/rblk/rblk/mirror"
)

// mirrorRig is an md RAID1 over two rblk devices (rblk-attach --device,
// through csidriver's attacher and package mirror, as rblk-mirror and
// the node plugin run them), each copy on a target of its own, with
// package mirror's supervisor running.
type mirrorRig struct {
	t       *testing.T
	tgs     [2]*target
	exports [2][]string
	o       mirror.Options
	att     *csidriver.RBLKAttacher
	legs    []mirror.Leg
	stop    context.CancelFunc
	done    chan struct{}
}

const mirrorFastFail = 2 * time.Second

func startMirror(t *testing.T, name string) *mirrorRig {
	t.Helper()
	if e2e.device != "nbd" {
		notApplicable(t, "the mirror is an md RAID1 over the kernel's /dev/nbdN (RBLK_E2E_DEVICE=nbd)")
	}
	needTools(t, "mdadm", "fio")
	if out, err := exec.Command("modprobe", "raid1").CombinedOutput(); err != nil {
		skipOrFail(t, "modprobe raid1: %v: %s", err, out)
	}
	dir := t.TempDir()
	// md copies a whole member through rblk when one comes back; the
	// emulated guest does that at about 170 KB/s, so there the copies
	// are 8 MiB (4 MiB of data past md's offset), not 16.
	size := "16M"
	if emulated() {
		size = "8M"
	}
	r := &mirrorRig{t: t, done: make(chan struct{})}
	r.att = &csidriver.RBLKAttacher{Bin: attachBin, HostID: "host-mirror-" + name, StateDir: filepath.Join(dir, "state"), AdoptTimeout: -1,
		Args: []string{"--fast-fail-timeout=" + mirrorFastFail.String(), "--reconnect-timeout=10m", "--keepalive-timeout=5s", "--restart-grace=60s", "--fail-on-lost-writes"}}
	ctx := context.Background()
	var members []string
	for i := range 2 {
		r.exports[i] = []string{"vol=" + filepath.Join(dir, "copy"+string(rune('a'+i))+".img") + ",size=" + size}
		r.tgs[i] = startTarget(t, r.exports[i])
		l := &csidriver.Leg{A: r.att, ID: name + "/" + string(rune('a'+i)),
			VolCtx: map[string]string{csidriver.CtxAddress: r.tgs[i].addr, csidriver.CtxExport: "vol", csidriver.CtxTransport: e2eTransport()}}
		dev, err := r.att.Attach(ctx, l.ID, l.VolCtx)
		if err != nil {
			t.Fatal(err)
		}
		r.legs, members = append(r.legs, l), append(members, dev)
	}
	r.o = mirror.Options{Name: name, Members: members, Fresh: true, Logger: zaptest.NewLogger(t)}
	if _, err := mirror.Up(ctx, r.o); err != nil {
		t.Fatal(err)
	}
	mdFastResync(t, r.o)
	sctx, cancel := context.WithCancel(ctx)
	r.stop = cancel
	go func() {
		defer close(r.done)
		mirror.Supervise(sctx, r.o, r.legs, 200*time.Millisecond)
	}()
	t.Cleanup(r.close)
	return r
}

// close stops the supervisor and the array, and detaches the copies.
func (r *mirrorRig) close() {
	r.stop()
	<-r.done
	if r.t.Failed() {
		r.dumpAttaches()
	}
	ctx, cancel := context.WithTimeout(context.Background(), patient(time.Minute))
	defer cancel()
	if err := mirror.Down(ctx, r.o); err != nil {
		r.t.Errorf("stop the array: %v", err)
	}
	for _, l := range r.legs {
		r.att.Detach(ctx, l.(*csidriver.Leg).ID)
	}
}

// dumpAttaches puts the logs of the copies' rblk-attach processes (which
// Detach removes) in the test's output, each after its goroutines' stacks
// (SIGQUIT: where a copy's IO waits, when the array did not degrade).
func (r *mirrorRig) dumpAttaches() {
	for _, pid := range attachProcs(r.t, r.att.StateDir) {
		if p, err := os.FindProcess(pid); err == nil && p.Signal(syscall.SIGQUIT) == nil {
			// (no Fatal in a cleanup: the array is still to be stopped)
			for end := time.Now().Add(patient(10 * time.Second)); slices.Contains(attachProcs(r.t, r.att.StateDir), pid); {
				if time.Now().After(end) {
					r.t.Logf("rblk-attach (pid %d) still runs after SIGQUIT", pid)
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	logs, _ := filepath.Glob(filepath.Join(r.att.StateDir, "*.log"))
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			r.t.Logf("%s: %v", l, err)
			continue
		}
		if len(b) > 256<<10 {
			b = b[len(b)-256<<10:]
		}
		r.t.Logf("%s (its end):\n%s", l, b)
	}
}

// waitState polls the array's state until cond holds, for up to timeout,
// and returns how long that took.
func (r *mirrorRig) waitState(timeout time.Duration, what string, cond func(*mirror.Status) bool) time.Duration {
	r.t.Helper()
	start := time.Now()
	pollUntil(r.t, timeout, what, func() bool {
		st, err := mirror.Stat(r.o)
		return err == nil && cond(st)
	})
	return time.Since(start)
}

// check runs md's check of the whole array and returns mismatch_cnt.
func (r *mirrorRig) check() uint64 {
	r.t.Helper()
	return mdCheck(r.t, r.o)
}

// mdFastResync lets md resync o's array at full speed while fio writes
// (by default it keeps to sync_speed_min, 1 MB/s, beside other IO): the
// drills' resync times are then rblk's, and the drills shorter.
func mdFastResync(t *testing.T, o mirror.Options) {
	t.Helper()
	st, err := mirror.Stat(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join("/sys/block", filepath.Base(st.Device), "md", "sync_speed_min"), []byte("200000\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// mdCheck runs md's check of o's whole array and returns mismatch_cnt.
func mdCheck(t *testing.T, o mirror.Options) uint64 {
	t.Helper()
	st, err := mirror.Stat(o)
	if err != nil {
		t.Fatal(err)
	}
	action := filepath.Join("/sys/block", filepath.Base(st.Device), "md", "sync_action")
	idle := func() bool {
		b, _ := os.ReadFile(action)
		return strings.TrimSpace(string(b)) == "idle"
	}
	// (A resync or recovery that runs, such as of a grown array's new
	// room, ends first: md takes no check meanwhile.)
	pollUntil(t, 5*time.Minute, "md's resync to end before its check", idle)
	if err := os.WriteFile(action, []byte("check\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	pollUntil(t, 5*time.Minute, "md's check to end", idle)
	st, err = mirror.Stat(o)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mismatches
}

// TestMirrorTargetKilled: fio writes with crc32c in every block to an md
// RAID1 over two rblk devices; one copy's rblkd is killed (SIGKILL). fio
// sees no error and the array is degraded within the fast-fail time; the
// rblkd is started again: the member comes back (from the bitmap, or in
// full if it lost acknowledged writes with the killed rblkd) and is
// resynced. md's check then finds no mismatch, and fio verifies every
// block it wrote. The same with SIGSTOP of one rblkd past its keepalive
// and the fast-fail time (the member comes back from the bitmap once it
// runs again). A planned restart (SIGTERM) of one rblkd degrades nothing.
// Then both copies go away: IO fails with EIO, and nothing hangs.
func TestMirrorTargetKilled(t *testing.T) {
	t.Parallel()
	r := startMirror(t, "e2e-mirror-kill")
	fioSize := "12m" // the whole array
	if emulated() {
		fioSize = "4m"
	}
	job := []string{"--name=mirror", "--filename=" + r.o.Path(), "--size=" + fioSize, "--rw=randwrite", "--bs=4k", "--ioengine=libaio",
		"--direct=1", "--iodepth=8", "--verify=crc32c", "--verify_fatal=1", "--exitall_on_error=1", "--verify_state_save=0"}
	written := func(i int) float64 {
		v, _ := metricSum(scrapeQuiet(r.tgs[i].metrics), "rblkd_written_bytes_total")
		return v
	}

	for _, fault := range []string{"SIGKILL", "SIGSTOP"} {
		fio := startFio(t, append(job, "--rate_iops=200")...)
		base := written(1)
		pollUntil(t, 2*time.Minute, "fio's writes to reach the copies", func() bool { return fio.exited() || written(1) >= base+1<<20 })
		p := r.tgs[1].cmd.Process
		switch fault {
		case "SIGKILL":
			r.tgs[1].kill9(t)
		case "SIGSTOP":
			if err := p.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Signal(syscall.SIGCONT) })
		}
		degrade := r.waitState(time.Minute, "the array degraded", func(st *mirror.Status) bool { return st.Degraded == 1 })
		switch fault {
		case "SIGKILL":
			r.tgs[1] = startTargetOn(t, r.tgs[1].addr, r.exports[1])
		case "SIGSTOP":
			if err := p.Signal(syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
		}
		resync := r.waitState(5*time.Minute, "the member back and resynced", func(st *mirror.Status) bool {
			return st.Healthy() && len(st.Members) == 2
		})
		t.Logf("%s of one copy's rblkd under fio: the array degraded %v later (fast-fail time %v); the member was back in sync %v after its rblkd ran again",
			fault, degrade.Round(100*time.Millisecond), mirrorFastFail, resync.Round(100*time.Millisecond))
		fio.wait(t)
		if n := r.check(); n != 0 {
			t.Fatalf("after %s: md's check found %d mismatched sectors", fault, n)
		}
	}
	// Every block fio wrote reads back (md reads from either copy; its
	// check above compared them all).
	checkFio(t, run(t, 4*time.Minute, "fio", append(append([]string{"--output-format=json"}, job...), "--verify_only")...))

	// A planned restart (SIGTERM: rblkd drains its sessions first) under
	// fio: the array never degrades.
	fio := startFio(t, append(job, "--rate_iops=200")...)
	base := written(1)
	pollUntil(t, 2*time.Minute, "fio's writes to reach the copies", func() bool { return fio.exited() || written(1) >= base+1<<20 })
	var maxDegraded int
	sampled := make(chan struct{})
	stopSampling := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if st, err := mirror.Stat(r.o); err == nil {
				maxDegraded = max(maxDegraded, st.Degraded)
			}
			select {
			case <-stopSampling:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	r.tgs[1].stop(t, stopTimeout)
	r.tgs[1] = startTargetOn(t, r.tgs[1].addr, r.exports[1])
	pollUntil(t, 2*time.Minute, "fio's writes to reach the restarted copy", func() bool { return fio.exited() || written(1) >= 1<<20 })
	close(stopSampling)
	<-sampled
	fio.wait(t)
	if maxDegraded != 0 {
		t.Fatalf("a planned restart of one copy's rblkd degraded the array (degraded %d)", maxDegraded)
	}
	if n := r.check(); n != 0 {
		t.Fatalf("after a planned restart: md's check found %d mismatched sectors", n)
	}

	// Both copies gone: IO fails, and nothing hangs.
	r.tgs[0].kill9(t)
	r.tgs[1].kill9(t)
	res := run(t, 2*time.Minute, "fio", "--name=gone", "--filename="+r.o.Path(), "--size=1m", "--rw=write", "--bs=4k",
		"--ioengine=libaio", "--direct=1", "--output-format=json")
	if res.code == 0 && !strings.Contains(res.stdout+res.stderr, "error") {
		t.Fatalf("writes with both copies gone did not fail: %s", res)
	}
	// (Back, so that the copies detach without waiting out their
	// reconnect.)
	for i := range 2 {
		r.tgs[i] = startTargetOn(t, r.tgs[i].addr, r.exports[i])
	}
}
