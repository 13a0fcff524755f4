package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// TestDashboardMetricsExist: every metric that a panel or variable of the
// Grafana dashboard (dashboards/rblk.json) or an alert rule
// (dashboards/alerts.yml) queries is exposed by a running rblkd or
// rblk-attach, after some IO through the NBD socket, with the RDMA
// counters read from a fixture sysfs tree (this machine has no RDMA
// device). A panel querying a metric that does not exist fails it.
func TestDashboardMetricsExist(t *testing.T) {
	onlyTransport(t, "tcp", "the RDMA counters come from a fixture sysfs tree (RBLK_SYSFS), which over rdma would hide the real device from the verbs provider; and rxe has no counters/* (port_xmit_data, ...) for the panels that query them (TestFio checks the real port's metrics over rdma)")
	dash := dashboardQueries(t, filepath.Join("..", "dashboards", "rblk.json"))
	alerts := alertQueries(t, filepath.Join("..", "dashboards", "alerts.yml"))
	if len(dash) < 20 || len(alerts) < 10 {
		t.Fatalf("%d dashboard queries and %d alert expressions: the files were not read as expected", len(dash), len(alerts))
	}

	sys := filepath.Join(t.TempDir(), "sys")
	port := filepath.Join(sys, "class", "infiniband", "rxe0", "ports", "1")
	for name, content := range map[string]string{
		"counters/port_xmit_data": "100", "counters/port_rcv_data": "100", "counters/port_xmit_packets": "10",
		"counters/port_rcv_packets": "10", "counters/symbol_error": "0", "counters/link_downed": "0",
		"hw_counters/sent_pkts": "10", "hw_counters/rcvd_pkts": "10", "state": "4: ACTIVE", "phys_state": "5: LinkUp",
		"link_layer": "Ethernet", "rate": "10 Gb/sec (1X QDR)", "../../hw_counters/duplicate_request": "0",
	} {
		p := filepath.Join(port, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("RBLK_SYSFS", sys) // inherited by the daemons

	// A pool too, for the pools' metrics.
	cfgDir := t.TempDir()
	cfg := filepath.Join(cfgDir, "rblkd.yaml")
	if err := os.WriteFile(cfg, []byte("admin_socket: "+filepath.Join(sockDir(t), "rblkd.sock")+"\npools:\n  - name: fast\n    directory: "+
		filepath.Join(cfgDir, "fast")+"\n    capacity: 64M\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tg := startTarget(t, []string{"vol=" + filepath.Join(t.TempDir(), "vol.img") + ",size=4M"}, "--chunk-size", "64K", "--config", cfg)
	a := startAttach(t, tg, "vol")
	n := dialNBD(t, a.sock, "vol")
	data := bytes.Repeat([]byte{0x3c}, 192<<10)
	for _, c := range []struct {
		typ uint16
		off uint64
		n   uint32
		p   []byte
	}{
		{nbdCmdWrite, 60 << 10, uint32(len(data)), data},
		{nbdCmdRead, 0, 256 << 10, nil},
		{nbdCmdTrim, 1 << 20, 64 << 10, nil},
		{nbdCmdWriteZeroes, 2 << 20, 64 << 10, nil},
		{nbdCmdFlush, 0, 0, nil},
	} {
		if errno, _, err := n.do(c.typ, c.off, c.n, c.p); err != nil || errno != 0 {
			t.Fatalf("NBD command %d at %d: errno %d, %v", c.typ, c.off, errno, err)
		}
	}
	waitMetric(t, tg.metrics, "rblkd_written_bytes_total", func(v float64) bool { return v >= float64(len(data)) }, "the bytes written")

	have := map[string]bool{}
	for _, addr := range []string{tg.metrics, a.metrics} {
		for _, name := range sampleNames(scrape(t, addr)) {
			have[name] = true
		}
	}
	for _, prefix := range []string{"rblkd_", "rblk_attach_", "rblk_rdma_"} {
		if !slices.ContainsFunc(keys(have), func(s string) bool { return strings.HasPrefix(s, prefix) }) {
			t.Fatalf("no %s* metric on the running daemons", prefix)
		}
	}
	// The check itself: a query of a metric nobody exposes is reported.
	if m := missing(map[string][]string{"probe": {`sum(rate(rblkd_no_such_metric_total{export=~"$export"}[5m]))`}}, have); len(m) != 1 {
		t.Fatalf("a query of rblkd_no_such_metric_total gave missing %v, want it reported", m)
	}
	used := 0
	for what, queries := range map[string]map[string][]string{"dashboards/rblk.json": dash, "dashboards/alerts.yml": alerts} {
		for _, m := range missing(queries, have) {
			t.Errorf("%s: %s", what, m)
		}
		for _, qs := range queries {
			for _, q := range qs {
				used += len(promqlMetrics(q))
			}
		}
	}
	t.Logf("%d metric references checked in %d dashboard and %d alert queries", used, len(dash), len(alerts))
	n.close()
	a.stop(t, 30*time.Second)
	tg.stop(t, 30*time.Second)
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// missing lists "WHERE queries METRIC, which no daemon exposes" for each
// metric of queries (WHERE: its queries) absent from have. Prometheus'
// own "up" is not a daemon's metric.
func missing(queries map[string][]string, have map[string]bool) []string {
	var out []string
	for where, qs := range queries {
		for _, q := range qs {
			for _, name := range promqlMetrics(q) {
				if !have[name] && name != "up" {
					out = append(out, where+" queries "+name+", which neither rblkd nor rblk-attach exposes (query: "+q+")")
				}
			}
		}
	}
	sort.Strings(out)
	return out
}

// dashboardQueries returns the PromQL of each panel's targets (by panel
// title) and of each templating variable, failing if a panel has none.
func dashboardQueries(t *testing.T, path string) map[string][]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Type, Title string
			Targets     []struct{ Expr string }
		}
		Templating struct {
			List []struct {
				Name, Type string
				Query      json.RawMessage
			}
		}
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	out := map[string][]string{}
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		for _, tg := range p.Targets {
			if tg.Expr != "" {
				out["panel "+p.Title] = append(out["panel "+p.Title], tg.Expr)
			}
		}
		if len(out["panel "+p.Title]) == 0 {
			t.Errorf("%s: panel %q has no query", path, p.Title)
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil || q.Query == "" {
			t.Errorf("%s: variable %s: query %s: want {\"query\": ...}", path, v.Name, v.Query)
			continue
		}
		out["variable "+v.Name] = []string{q.Query}
	}
	return out
}

// alertQueries returns the expr of each alert rule of path, by alert name.
// The file keeps each expression on one line.
func alertQueries(t *testing.T, path string) map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string][]string{}
	alert := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if a, ok := strings.CutPrefix(line, "- alert:"); ok {
			alert = strings.TrimSpace(a)
		}
		if e, ok := strings.CutPrefix(line, "expr:"); ok {
			e = strings.TrimSpace(e)
			if e == "" || e == "|" || e == ">" || alert == "" {
				t.Fatalf("%s: alert %q: want a one-line expr", path, alert)
			}
			out["alert "+alert] = append(out["alert "+alert], e)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

var (
	grafanaVarRE  = regexp.MustCompile(`\$\{[^}]*\}|\$\w+`)
	labelValuesRE = regexp.MustCompile(`label_values\(([^,()]*(?:\{[^}]*\})?)\s*,\s*\w+\s*\)`)
	stringRE      = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|` + "`[^`]*`")
	matcherRE     = regexp.MustCompile(`\{[^}]*\}|\[[^\]]*\]`)
	groupingRE    = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	identRE       = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	promqlWords   = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true, "by": true,
		"without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true, "inf": true, "nan": true,
		"Inf": true, "NaN": true}
)

// promqlMetrics returns the metric names a PromQL expression (with Grafana
// variables) selects: identifiers that are not functions, keywords, label
// names of matchers or groupings, or parts of numbers and durations.
func promqlMetrics(expr string) []string {
	e := labelValuesRE.ReplaceAllString(expr, "$1")
	e = stringRE.ReplaceAllString(e, `""`)
	e = grafanaVarRE.ReplaceAllString(e, "")
	e = matcherRE.ReplaceAllString(e, " ")
	e = groupingRE.ReplaceAllString(e, " ")
	var out []string
	for _, loc := range identRE.FindAllStringIndex(e, -1) {
		name := e[loc[0]:loc[1]]
		if loc[0] > 0 && strings.ContainsAny(e[loc[0]-1:loc[0]], "0123456789.") {
			continue // 1e3, 5m
		}
		if rest := strings.TrimLeft(e[loc[1]:], " \t\n"); strings.HasPrefix(rest, "(") || promqlWords[name] {
			continue // a function or a keyword
		}
		if !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}

// sampleNames returns the names of the samples of a /metrics text: a
// histogram's are NAME_bucket, NAME_sum and NAME_count, as queries name
// them.
func sampleNames(text string) []string {
	var out []string
	seen := map[string]bool{}
	for _, line := range strings.Split(text, "\n") {
		m := sampleRE.FindStringSubmatch(line)
		if m == nil || strings.HasPrefix(line, "#") || seen[m[1]] {
			continue
		}
		seen[m[1]] = true
		out = append(out, m[1])
	}
	return out
}

// TestPromQLMetrics: the extraction the dashboard test relies on.
func TestPromQLMetrics(t *testing.T) {
	for expr, want := range map[string][]string{
		`histogram_quantile(0.99, sum by (le, op) (rate(rblk_attach_nbd_request_duration_seconds_bucket{instance=~"$attach"}[$__rate_interval])))`: {"rblk_attach_nbd_request_duration_seconds_bucket"},
		`sum by (instance) (rblkd_cache_used_bytes) / sum by (instance) (rblkd_cache_budget_bytes) > 0.95 and sum(rate(x_total[5m])) > 1e3`:        {"rblkd_cache_used_bytes", "rblkd_cache_budget_bytes", "x_total"},
		`label_values(rblkd_export_size_bytes{instance=~"$target"}, export)`:                                                                       {"rblkd_export_size_bytes"},
		`4 * sum by (device, port, counter) (rate(rblk_rdma_port_counters_total{counter=~"port_(xmit|rcv)_data"}[${__rate_interval}])) > 0`:        {"rblk_rdma_port_counters_total"},
		`up{job="rblkd"} == 0 unless on (instance) a offset 5m`:                                                                                    {"up", "a"},
	} {
		if got := promqlMetrics(expr); !slices.Equal(got, want) {
			t.Errorf("promqlMetrics(%s) = %q, want %q", expr, got, want)
		}
	}
}
