// Package metricstest reads values out of a Prometheus registry for
// tests: one lookup in place of a Gather loop in every test file.
package metricstest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Sum gathers g and returns the sum, over the series of the metric called
// name that carry every label and value of labels (given in pairs: "export",
// "vol", "reason", "auth"), of each series' counter or gauge value or
// histogram sample count, and how many series matched. A failed Gather or
// an odd number of labels fails the test.
func Sum(t testing.TB, g prometheus.Gatherer, name string, labels ...string) (float64, int) {
	t.Helper()
	if len(labels)%2 != 0 {
		t.Fatalf("metricstest.Sum(%s): labels %q are not pairs", name, labels)
	}
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gather metrics: %v", err)
	}
	var sum float64
	n := 0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !hasLabels(m, labels) {
				continue
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
			n++
		}
	}
	return sum, n
}

// Value is Sum for a metric that must exist: no matching series fails the
// test.
func Value(t testing.TB, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	v, n := Sum(t, g, name, labels...)
	if n == 0 {
		t.Fatalf("no series %s%q", name, labels)
	}
	return v
}

func hasLabels(m *dto.Metric, labels []string) bool {
	for i := 0; i < len(labels); i += 2 {
		found := false
		for _, lp := range m.GetLabel() {
			if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}
