package doctor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"text/tabwriter"
)

// Check is one thing a daemon needs, checked.
type Check struct {
	// Name says what was checked: "rdma devices", "nbd module", "export vol".
	Name string `json:"name"`
	// OK: the check passed.
	OK bool `json:"ok"`
	// Needed: a failure of this check makes the run fail (exit non-zero),
	// given the transport and device asked for.
	Needed bool `json:"needed"`
	// Detail is what was found.
	Detail string `json:"detail"`
	// Fix says what to do when the check failed ("" when it passed).
	Fix string `json:"fix"`
}

// Transports of the --transport flag.
const (
	TransportTCP  = "tcp"
	TransportRDMA = "rdma"
	TransportAuto = "auto"
)

// ParseTransport checks a --transport value.
func ParseTransport(s string) (string, error) {
	switch s {
	case TransportTCP, TransportRDMA, TransportAuto:
		return s, nil
	}
	return "", fmt.Errorf("--transport %q: want tcp, rdma or auto", s)
}

// Env is where the checks look: the roots of the kernel's file systems and
// the folders of shared libraries. DefaultEnv is the real machine's.
type Env struct {
	SysRoot     string   // /sys
	ProcRoot    string   // /proc
	DevRoot     string   // /dev
	ModulesRoot string   // /lib/modules
	LibDirs     []string // where libibverbs.so.1 and librdmacm.so.1 are looked for
	// UID is the user the daemon runs as (the doctor's own): files it
	// reads must be owned by it or by root.
	UID int
	// RDMASupported: this build has the verbs provider (build tag rdma).
	RDMASupported bool
	// Clock reports whether the system clock is synchronized, and how far
	// off it may be (its maximum error); nil: DefaultEnv's, through
	// adjtimex(2).
	Clock func() (synced bool, detail string, err error)
}

// DefaultEnv reads the real machine.
func DefaultEnv(rdmaSupported bool) Env {
	arch := map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu",
		"s390x": "s390x-linux-gnu", "riscv64": "riscv64-linux-gnu"}[runtime.GOARCH]
	var libs []string
	if arch != "" {
		libs = append(libs, "/usr/lib/"+arch, "/lib/"+arch)
	}
	libs = append(libs, "/usr/lib64", "/lib64", "/usr/lib", "/lib", "/usr/local/lib")
	return Env{SysRoot: "/sys", ProcRoot: "/proc", DevRoot: "/dev", ModulesRoot: "/lib/modules", LibDirs: libs,
		UID: os.Geteuid(), RDMASupported: rdmaSupported, Clock: adjtimexClock}
}

func (e Env) sys(p ...string) string  { return filepath.Join(append([]string{e.SysRoot}, p...)...) }
func (e Env) proc(p ...string) string { return filepath.Join(append([]string{e.ProcRoot}, p...)...) }
func (e Env) dev(p ...string) string  { return filepath.Join(append([]string{e.DevRoot}, p...)...) }

// readTrim reads a small file and trims its white space.
func readTrim(path string) (string, error) {
	b, err := os.ReadFile(path)
	return strings.TrimSpace(string(b)), err
}

// Failed counts the checks that failed, and of them the needed ones.
func Failed(checks []Check) (failed, needed int) {
	for _, c := range checks {
		if !c.OK {
			failed++
			if c.Needed {
				needed++
			}
		}
	}
	return failed, needed
}

// WriteJSON writes checks as a JSON list of {"name", "ok", "needed",
// "detail", "fix"}.
func WriteJSON(w io.Writer, checks []Check) error {
	if checks == nil {
		checks = []Check{}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(checks)
}

// WriteTable writes checks for people: one line each (OK, FAIL for a
// needed check that failed, WARN for another), the fix under each failure,
// then a summary line.
func WriteTable(w io.Writer, checks []Check) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, c := range checks {
		mark := "✔ OK"
		switch {
		case !c.OK && c.Needed:
			mark = "✘ FAIL"
		case !c.OK:
			mark = "! WARN"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", mark, c.Name, c.Detail)
		if !c.OK && c.Fix != "" {
			fmt.Fprintf(tw, "\t\tfix: %s\n", c.Fix)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, Summary(checks))
	return err
}

// Summary is the last line of WriteTable.
func Summary(checks []Check) string {
	failed, needed := Failed(checks)
	switch {
	case failed == 0:
		return fmt.Sprintf("all %d checks passed", len(checks))
	case needed == 0:
		return fmt.Sprintf("%d of %d checks failed, none of them needed: good to go (see the warnings)", failed, len(checks))
	}
	return fmt.Sprintf("%d of %d checks failed, %d of them needed: fix those first", failed, len(checks), needed)
}

// ErrNeededFailed is returned by Report when a needed check failed: the
// commands exit non-zero.
var ErrNeededFailed = errors.New("doctor: needed checks failed")

// Report writes checks as a table, or as JSON, and returns an error
// matching ErrNeededFailed if a needed check failed.
func Report(w io.Writer, checks []Check, asJSON bool) error {
	write := WriteTable
	if asJSON {
		write = WriteJSON
	}
	if err := write(w, checks); err != nil {
		return fmt.Errorf("write the checks: %w", err)
	}
	if _, needed := Failed(checks); needed > 0 {
		return fmt.Errorf("%w: %d of %d (see the fixes above)", ErrNeededFailed, needed, len(checks))
	}
	return nil
}
