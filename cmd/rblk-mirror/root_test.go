package main

import (
	"strings"
	"testing"
)

func TestParseLeg(t *testing.T) {
	for in, want := range map[string][2]string{
		"vol@10.0.0.1:7480":         {"vol", "10.0.0.1:7480"},
		"fast:pvc-1@[fd00::1]:7480": {"fast:pvc-1", "[fd00::1]:7480"},
	} {
		e, tg, err := parseLeg(in)
		if err != nil || e != want[0] || tg != want[1] {
			t.Errorf("parseLeg(%q) = %q, %q, %v", in, e, tg, err)
		}
	}
	for _, bad := range []string{"vol", "@10.0.0.1:7480", "vol@"} {
		if _, _, err := parseLeg(bad); err == nil {
			t.Errorf("parseLeg(%q): no error", bad)
		}
	}
}

// up refuses bad flags with one line that says which, before it attaches
// anything.
func TestUpRefusesBadFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--name", "a/b", "--leg", "v@h:1", "--leg", "v@h:2"}, "--name"},
		{[]string{"--name", "m", "--leg", "v@h:1"}, "want 2 copies"},
		{[]string{"--name", "m", "--leg", "v@h:1", "--leg", "v@h:2", "--fast-fail-timeout", "0"}, "--fast-fail-timeout"},
		{[]string{"--name", "m", "--leg", "v@h:1", "--leg", "v@h:2", "--fast-fail-timeout", "1m", "--reconnect-timeout", "30s"}, "--fast-fail-timeout"},
		{[]string{"--name", "m", "--leg", "v@h:1", "--leg", "v", "--host-id", "h1"}, "want EXPORT@HOST:PORT"},
		{[]string{"--name", "m", "--leg", "v@h:1", "--leg", "v@h:2", "--host-id", "h1", "--metrics-listen", "127.0.0.1:99999"}, "--metrics-listen"},
	} {
		cmd := newRootCmd()
		cmd.SetArgs(append([]string{"up", "--attach-bin", "/nonexistent/rblk-attach", "--state-dir", t.TempDir()}, c.args...))
		err := cmd.Execute()
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("up %q: %v, want one line with %q", c.args, err, c.want)
		}
	}
}

// grow refuses a name md cannot have, and an array that is not up.
func TestGrowRefuses(t *testing.T) {
	for _, c := range []struct{ name, want string }{{"a/b", "array name"}, {"rblk-test-not-up", "not assembled"}} {
		cmd := newRootCmd()
		cmd.SetArgs([]string{"grow", c.name})
		if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("grow %s: %v, want %q", c.name, err, c.want)
		}
	}
}
