package e2e

import (
	"path/filepath"
	"strconv"
	"testing"
)

// mallocs is a process's go_memstats_mallocs_total, read from its /metrics.
func mallocs(t *testing.T, addr string) float64 {
	t.Helper()
	return metric(t, addr, "go_memstats_mallocs_total")
}

// TestAllocsPerIO: the whole rblk-attach process (NBD server, volume, link,
// software transport) makes no heap allocation per 4 KiB read or write once
// the chunks are granted. fio's nbd engine drives it, and the Go runtime's
// own malloc counter, scraped from /metrics, says how many it made. Each
// job runs twice, with n and with 5n IOs: what a run costs apart from its
// IOs (fio's connection, its handshake, a scrape's own allocations) is the
// same in both, so the difference over 4n is the cost of an IO. rblkd's
// figure is logged beside it.
func TestAllocsPerIO(t *testing.T) {
	needTools(t, "fio")
	dir := t.TempDir()
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=16M"}, "--cache-size", "64M")
	at := startAttach(t, tg, "vol")
	// Grants for every chunk first, and the pools warm.
	runFio(t, at.uri("vol"), "--rw=randrw", "--bs=4k", "--iodepth=8", "--size=16M", "--io_size=16M")
	const n = 4000
	run := func(ios int, args []string) (attach, target float64) {
		a0, t0 := mallocs(t, at.metrics), mallocs(t, tg.metrics)
		runFio(t, at.uri("vol"), append([]string{"--bs=4k", "--size=16M", "--io_size=1G",
			"--number_ios=" + strconv.Itoa(ios)}, args...)...)
		return mallocs(t, at.metrics) - a0, mallocs(t, tg.metrics) - t0
	}
	for _, job := range []struct {
		name string
		args []string
	}{
		{"randread QD1", []string{"--rw=randread", "--iodepth=1"}},
		{"randwrite QD1", []string{"--rw=randwrite", "--iodepth=1"}},
		{"randread QD16", []string{"--rw=randread", "--iodepth=16"}},
		{"randwrite QD16", []string{"--rw=randwrite", "--iodepth=16"}},
	} {
		a1, t1 := run(n, job.args)
		a5, t5 := run(5*n, job.args)
		per, tper := (a5-a1)/(4*n), (t5-t1)/(4*n)
		t.Logf("%s: rblk-attach %.4f allocations per IO (%.0f for %d IOs, %.0f for %d), rblkd %.4f per IO",
			job.name, per, a1, n, a5, 5*n, tper)
		// The scrapes' own allocations vary by a few hundred, which is
		// ±0.1 per IO here: this bound catches an allocation on every IO
		// or every other one. TestSubmitAllocs (initiator) and
		// TestNoAllocPerIO (nbd) hold the parts to 0 exactly.
		if per > 0.5 {
			t.Errorf("%s: rblk-attach made %.4f heap allocations per IO, want 0", job.name, per)
		}
	}
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}
