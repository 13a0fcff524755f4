package mirror

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The metrics follow the array: degraded with a failed member, the
// recovery's progress while it runs, the members put back by kind; an
// array untracked, or not assembled, is not exported.
func TestMetrics(t *testing.T) {
	ctx := context.Background()
	f, o := newFakeMD(t)
	m := NewMetrics()
	o.Members, o.Added = []string{f.Dev("nbd0"), f.Dev("nbd1")}, m.Added
	if _, err := Up(ctx, o); err != nil {
		t.Fatal(err)
	}
	m.Track(o)
	f.SetState(f.Dev("nbd1"), "faulty")
	want := `
# HELP rblk_mirror_degraded Members the array lacks: missing or failed (0: both copies serve).
# TYPE rblk_mirror_degraded gauge
rblk_mirror_degraded{array="vol1"} 1
# HELP rblk_mirror_members_in_sync Members that hold the whole array.
# TYPE rblk_mirror_members_in_sync gauge
rblk_mirror_members_in_sync{array="vol1"} 1
# HELP rblk_mirror_resyncing 1 while md copies data onto a member (recover or resync), else 0.
# TYPE rblk_mirror_resyncing gauge
rblk_mirror_resyncing{array="vol1"} 0
`
	names := []string{"rblk_mirror_degraded", "rblk_mirror_members_in_sync", "rblk_mirror_resyncing"}
	if err := testutil.CollectAndCompare(m, strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}

	// Re-added, md recovers it: a quarter done.
	if err := Add(ctx, o, f.Dev("nbd1"), false); err != nil {
		t.Fatal(err)
	}
	md := filepath.Join(f.Root, "sys", "block", "md0", "md")
	os.WriteFile(filepath.Join(md, "sync_action"), []byte("recover\n"), 0o644)
	os.WriteFile(filepath.Join(md, "sync_completed"), []byte("2048 / 8192\n"), 0o644)
	want = `
# HELP rblk_mirror_members_added_total Members put back into the array: from the bitmap (what changed while it was away) or in full.
# TYPE rblk_mirror_members_added_total counter
rblk_mirror_members_added_total{array="vol1",from="bitmap"} 1
# HELP rblk_mirror_resyncing 1 while md copies data onto a member (recover or resync), else 0.
# TYPE rblk_mirror_resyncing gauge
rblk_mirror_resyncing{array="vol1"} 1
# HELP rblk_mirror_sync_progress_ratio How far the running resync, recovery or check is (0 to 1); 1 when none runs.
# TYPE rblk_mirror_sync_progress_ratio gauge
rblk_mirror_sync_progress_ratio{array="vol1"} 0.25
# HELP rblk_mirror_sync_remaining_bytes Bytes the running resync, recovery or check has still to go; 0 when none runs.
# TYPE rblk_mirror_sync_remaining_bytes gauge
rblk_mirror_sync_remaining_bytes{array="vol1"} 3.145728e+06
`
	names = []string{"rblk_mirror_members_added_total", "rblk_mirror_resyncing", "rblk_mirror_sync_progress_ratio", "rblk_mirror_sync_remaining_bytes"}
	if err := testutil.CollectAndCompare(m, strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}

	m.Untrack("vol1")
	if n := testutil.CollectAndCount(m); n != 0 {
		t.Errorf("%d metrics after Untrack", n)
	}
}
