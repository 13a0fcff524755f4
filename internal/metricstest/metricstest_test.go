package metricstest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestSum(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total"}, []string{"export", "reason"})
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "h_seconds"}, []string{"export"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g"})
	reg.MustRegister(c, h, g)
	c.WithLabelValues("a", "x").Add(2)
	c.WithLabelValues("a", "y").Add(3)
	c.WithLabelValues("b", "x").Add(5)
	h.WithLabelValues("a").Observe(1)
	h.WithLabelValues("a").Observe(9)
	g.Set(7)
	for _, tc := range []struct {
		name   string
		labels []string
		sum    float64
		n      int
	}{
		{"c_total", nil, 10, 3},
		{"c_total", []string{"export", "a"}, 5, 2},
		{"c_total", []string{"export", "a", "reason", "y"}, 3, 1},
		{"c_total", []string{"export", "c"}, 0, 0},
		{"c_total", []string{"nolabel", "a"}, 0, 0},
		{"h_seconds", []string{"export", "a"}, 2, 1},
		{"g", nil, 7, 1},
		{"missing", nil, 0, 0},
	} {
		if sum, n := Sum(t, reg, tc.name, tc.labels...); sum != tc.sum || n != tc.n {
			t.Errorf("Sum(%s, %q) = %v, %d; want %v, %d", tc.name, tc.labels, sum, n, tc.sum, tc.n)
		}
	}
	if v := Value(t, reg, "c_total", "reason", "x"); v != 7 {
		t.Errorf("Value(c_total{reason=x}) = %v, want 7", v)
	}
}
