package transporttest

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

// CheckGoroutines fails t if goroutines started after the call are still
// running when t ends (after t's other cleanups, provided CheckGoroutines is
// called first). It retries for a while, since closed connections may take a
// moment to unwind. It is not meant for tests running in parallel.
func CheckGoroutines(t testing.TB) {
	t.Helper()
	base := make(map[string]bool)
	for _, g := range goroutines() {
		base[g.id] = true
	}
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			var leaked []string
			self := currentID()
			for _, g := range goroutines() {
				if !base[g.id] && g.id != self && !ignorable(g.stack) {
					leaked = append(leaked, g.stack)
				}
			}
			if len(leaked) == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("%d goroutine(s) leaked:\n\n%s", len(leaked), strings.Join(leaked, "\n\n"))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

type goroutine struct {
	id    string
	stack string
}

func stacks(all bool) []byte {
	buf := make([]byte, 64<<10)
	for {
		n := runtime.Stack(buf, all)
		if n < len(buf) {
			return buf[:n]
		}
		buf = make([]byte, 2*len(buf))
	}
}

// goroutines parses the dump of all goroutines.
func goroutines() []goroutine {
	var gs []goroutine
	for _, s := range strings.Split(string(stacks(true)), "\n\n") {
		if id, ok := parseID(s); ok {
			gs = append(gs, goroutine{id: id, stack: s})
		}
	}
	return gs
}

func currentID() string {
	id, _ := parseID(string(stacks(false)))
	return id
}

// parseID takes N from "goroutine N [state]:".
func parseID(s string) (string, bool) {
	rest, ok := strings.CutPrefix(s, "goroutine ")
	if !ok {
		return "", false
	}
	id, _, ok := strings.Cut(rest, " ")
	return id, ok
}

// ignorable reports goroutines of the runtime or the test framework: test
// goroutines (a parent waiting in t.Run) and signal handling.
func ignorable(stack string) bool {
	for _, s := range []string{"testing.tRunner(", "testing.(*M).", "os/signal.signal_recv", "runtime.ensureSigM"} {
		if strings.Contains(stack, s) {
			return true
		}
	}
	return false
}
