package target

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestDeleteExportMetrics: deleteExport removes every series of the export
// and only those.
func TestDeleteExportMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	x, y := m.forExport("x"), m.forExport("y")
	x.grants.Inc()
	y.grants.Inc()
	x.flushSeconds.Observe(1)
	count := func(export string) int {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, mf := range mfs {
			for _, s := range mf.GetMetric() {
				for _, lp := range s.GetLabel() {
					if lp.GetName() == "export" && lp.GetValue() == export {
						n++
					}
				}
			}
		}
		return n
	}
	if nx, ny := count("x"), count("y"); nx != 11 || ny != 11 {
		t.Fatalf("series of x, y: %d, %d; want 11 each", nx, ny)
	}
	m.deleteExport("x")
	if nx, ny := count("x"), count("y"); nx != 0 || ny != 11 {
		t.Fatalf("after deleteExport(x), series of x, y: %d, %d; want 0, 11", nx, ny)
	}
}
