package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// doctorCheck is one entry of doctor --json.
type doctorCheck struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Needed bool   `json:"needed"`
	Detail string `json:"detail"`
	Fix    string `json:"fix"`
}

// runDoctor runs bin doctor args... --json and returns its checks and exit
// code, after checking that every check has the four keys of the issue
// (name, ok, detail, fix) and needed.
func runDoctor(t *testing.T, bin string, args ...string) ([]doctorCheck, result) {
	t.Helper()
	r := run(t, 60*time.Second, bin, append(append([]string{"doctor"}, args...), "--json")...)
	var raw []map[string]json.RawMessage
	if err := json.Unmarshal([]byte(r.stdout), &raw); err != nil {
		t.Fatalf("%s doctor %s --json: stdout is no JSON list: %v\n%s", filepath.Base(bin), strings.Join(args, " "), err, r)
	}
	for _, c := range raw {
		for _, k := range []string{"name", "ok", "needed", "detail", "fix"} {
			if _, ok := c[k]; !ok {
				t.Errorf("check %s lacks the key %q", c["name"], k)
			}
		}
	}
	var checks []doctorCheck
	if err := json.Unmarshal([]byte(r.stdout), &checks); err != nil {
		t.Fatal(err)
	}
	if len(checks) == 0 {
		t.Fatalf("doctor reported no checks: %s", r)
	}
	return checks, r
}

func findCheck(t *testing.T, checks []doctorCheck, name string) doctorCheck {
	t.Helper()
	for _, c := range checks {
		if c.Name == name || strings.HasPrefix(c.Name, name+" ") {
			return c
		}
	}
	t.Fatalf("no check %q among %+v", name, checks)
	return doctorCheck{}
}

// neededFailures lists the needed checks that failed.
func neededFailures(checks []doctorCheck) []string {
	var out []string
	for _, c := range checks {
		if c.Needed && !c.OK {
			out = append(out, c.Name+": "+c.Detail)
		}
	}
	return out
}

// hasRDMADevice and hasNBD report what this machine has: the build
// machine has neither (the qemu guest of vm/ has both).
func hasRDMADevice() bool {
	ents, _ := os.ReadDir("/sys/class/infiniband")
	return len(ents) > 0
}

func hasNBD() bool {
	_, err := os.Stat("/sys/module/nbd")
	return err == nil
}

// TestDoctorRDMA: on this machine (no RDMA device, no nbd module, binaries
// built without -tags rdma) the doctors asked for --transport rdma (and
// --device nbd) exit non-zero and name the missing RDMA device and nbd
// module with their fixes, in the table and in --json. Over rdma (a device,
// binaries built with -tags rdma: the guest of vm/) it is the other way
// round: doctorWithRDMA.
func TestDoctorRDMA(t *testing.T) {
	t.Parallel()
	if e2e.transport == "rdma" {
		doctorWithRDMA(t)
		return
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "vol.img")
	listen := fmt.Sprintf("127.0.0.1:%d", freePort(t))

	checks, r := runDoctor(t, attachBin, "--transport", "rdma", "--device", "nbd", "--host-id", "e2e-doctor")
	if r.code != 1 {
		t.Errorf("rblk-attach doctor --transport rdma --device nbd: exit %d, want 1\n%s", r.code, r)
	}
	if !strings.Contains(r.stderr, "needed checks failed") {
		t.Errorf("stderr does not say that needed checks failed: %q", r.stderr)
	}
	dev := findCheck(t, checks, "rdma devices")
	if !dev.Needed {
		t.Errorf("with --transport rdma the RDMA device is not needed: %+v", dev)
	}
	if hasRDMADevice() {
		t.Logf("this machine has an RDMA device: %+v", dev)
	} else if dev.OK || !strings.Contains(dev.Fix, "modprobe rdma_rxe") || !strings.Contains(dev.Fix, "--transport tcp") {
		t.Errorf("the missing RDMA device: %+v, want a failure whose fix says modprobe rdma_rxe and --transport tcp", dev)
	}
	if b := findCheck(t, checks, "rdma support in this build"); b.OK || !strings.Contains(b.Fix, "-tags rdma") {
		t.Errorf("binaries built without -tags rdma: %+v, want a failure saying -tags rdma", b)
	}
	nbd := findCheck(t, checks, "nbd module")
	if !nbd.Needed {
		t.Errorf("with --device nbd the nbd module is not needed: %+v", nbd)
	}
	if hasNBD() {
		t.Logf("this machine has the nbd module: %+v", nbd)
	} else if nbd.OK || !strings.Contains(nbd.Fix, "modprobe nbd") {
		t.Errorf("the missing nbd module: %+v, want a failure whose fix says modprobe nbd", nbd)
	}

	checks, r = runDoctor(t, rblkdBin, "--transport", "rdma", "--listen", listen, "--export", "vol="+img+",size=1M", "--cache-size", "16M")
	if r.code != 1 {
		t.Errorf("rblkd doctor --transport rdma: exit %d, want 1\n%s", r.code, r)
	}
	if dev := findCheck(t, checks, "rdma devices"); !hasRDMADevice() && (dev.OK || !dev.Needed || !strings.Contains(dev.Fix, "rdma link add")) {
		t.Errorf("rblkd: the missing RDMA device: %+v", dev)
	}
	if l := findCheck(t, checks, "listen"); !hasRDMADevice() && (l.OK || !strings.Contains(l.Detail, "no RDMA device")) {
		t.Errorf("rblkd: listening over rdma without a device: %+v", l)
	}
	if x := findCheck(t, checks, "export vol"); !x.OK || !strings.Contains(x.Detail, "rblkd creates it") {
		t.Errorf("export to be created: %+v", x)
	}

	// The table for people: every failure with its fix, and a summary.
	r = run(t, 60*time.Second, attachBin, "doctor", "--transport", "rdma", "--device", "nbd", "--host-id", "e2e-doctor")
	if r.code != 1 || !strings.Contains(r.stdout, "✘ FAIL  rdma devices") || !strings.Contains(r.stdout, "fix: ") ||
		!strings.Contains(r.stdout, "of them needed: fix those first") {
		t.Errorf("rblk-attach doctor table:\n%s", r)
	}
	if !hasNBD() && !strings.Contains(r.stdout, "✘ FAIL  nbd module") {
		t.Errorf("the table does not show the nbd module failing:\n%s", r.stdout)
	}
}

// doctorWithRDMA: where the RDMA stack is there (RBLK_E2E_TRANSPORT=rdma),
// rblkd doctor --transport rdma on the address of the run and rblk-attach
// doctor --transport rdma --target against a running rblkd pass every
// needed check (exit 0), the RDMA device and this build's rdma support
// among them; with RBLK_E2E_DEVICE=nbd, --device nbd's checks too.
func doctorWithRDMA(t *testing.T) {
	t.Helper()
	dir := t.TempDir()
	img := filepath.Join(dir, "vol.img")
	tg := startTarget(t, []string{"vol=" + img + ",size=4M"})
	checks, r := runDoctor(t, rblkdBin, "--transport", "rdma", "--listen", hostPort(freePort(t)), "--allow-unauthenticated",
		"--export", "vol="+filepath.Join(dir, "other.img")+",size=1M", "--cache-size", "16M")
	if r.code != 0 || len(neededFailures(checks)) > 0 {
		t.Errorf("rblkd doctor --transport rdma with an RDMA device: exit %d, needed failures %v\n%s", r.code, neededFailures(checks), r)
	}
	for _, name := range []string{"rdma devices", "listen"} {
		if c := findCheck(t, checks, name); !c.OK || !c.Needed {
			t.Errorf("rblkd doctor --transport rdma: check %q: %+v, want a needed check that passes", name, c)
		}
	}
	device := "none"
	if e2e.device == "nbd" {
		device = "nbd"
	}
	checks, r = runDoctor(t, attachBin, "--transport", "rdma", "--device", device, "--host-id", "e2e-doctor", "--target", tg.addr)
	if r.code != 0 || len(neededFailures(checks)) > 0 {
		t.Errorf("rblk-attach doctor --transport rdma --device %s --target: exit %d, needed failures %v\n%s", device, r.code, neededFailures(checks), r)
	}
	for _, name := range []string{"rdma-core libraries", "rdma devices", "rdma port", "target"} {
		if c := findCheck(t, checks, name); !c.OK || !c.Needed {
			t.Errorf("rblk-attach doctor --transport rdma: check %q: %+v, want a needed check that passes", name, c)
		}
	}
	if device == "nbd" {
		if c := findCheck(t, checks, "nbd module"); !c.OK || !c.Needed {
			t.Errorf("rblk-attach doctor --device nbd: %+v, want a needed check that passes", c)
		}
	}
	tg.stop(t, stopTimeout)
}

// TestDoctorTCP: where nothing of RDMA is needed, the doctors pass (exit
// 0) against a running rblkd: rblkd doctor knows its port is served by
// rblkd, rblk-attach doctor reaches it, and the secret and auth files are
// private.
func TestDoctorTCP(t *testing.T) {
	t.Parallel()
	onlyTransport(t, "tcp", "the doctors' checks for --transport tcp; TestDoctorRDMA has those of rdma")
	dir := t.TempDir()
	img := filepath.Join(dir, "vol.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	secret := strings.Repeat("5e", 16)
	authFile := filepath.Join(dir, "auth")
	secretFile := filepath.Join(dir, "secret")
	if err := os.WriteFile(authFile, []byte("e2e-doctor "+secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(secretFile, []byte(secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tg := startTarget(t, []string{"vol=" + img}, "--auth-file", authFile)

	checks, r := runDoctor(t, rblkdBin, "--transport", "tcp", "--listen", tg.addr, "--auth-file", authFile, "--export", "vol="+img, "--cache-size", "16M")
	if r.code != 0 || len(neededFailures(checks)) > 0 {
		t.Errorf("rblkd doctor --transport tcp: exit %d, needed failures %v\n%s", r.code, neededFailures(checks), r)
	}
	if l := findCheck(t, checks, "listen"); !l.OK || !strings.Contains(l.Detail, fmt.Sprintf("rblkd (pid %d) serves on it already", tg.cmd.Process.Pid)) {
		t.Errorf("listen check on rblkd's own port: %+v", l)
	}
	if a := findCheck(t, checks, "auth file"); !a.OK || !strings.Contains(a.Detail, "1 hosts") {
		t.Errorf("auth file check: %+v", a)
	}
	for _, c := range checks {
		if strings.HasPrefix(c.Name, "rdma") {
			t.Errorf("--transport tcp checks %q", c.Name)
		}
	}

	checks, r = runDoctor(t, attachBin, "--transport", "tcp", "--device", "none", "--host-id", "e2e-doctor",
		"--secret-file", secretFile, "--target", tg.addr)
	if r.code != 0 || len(neededFailures(checks)) > 0 {
		t.Errorf("rblk-attach doctor --transport tcp --device none: exit %d, needed failures %v\n%s", r.code, neededFailures(checks), r)
	}
	if c := findCheck(t, checks, "target"); !c.OK || !c.Needed {
		t.Errorf("target check against a running rblkd: %+v", c)
	}
	if c := findCheck(t, checks, "secret file"); !c.OK || !c.Needed {
		t.Errorf("secret file check: %+v", c)
	}

	// A secret others may read fails, with the chmod that fixes it.
	if err := os.Chmod(secretFile, 0o644); err != nil {
		t.Fatal(err)
	}
	checks, r = runDoctor(t, attachBin, "--transport", "tcp", "--device", "none", "--host-id", "e2e-doctor", "--secret-file", secretFile)
	if c := findCheck(t, checks, "secret file"); r.code != 1 || c.OK || c.Fix != "chmod 600 "+secretFile {
		t.Errorf("secret file of mode 0644: exit %d, %+v", r.code, c)
	}
	tg.stop(t, stopTimeout)

	// --config: doctor checks what the file configures (its listen address,
	// transport and exports), flags over it; a bad file is refused with its
	// line.
	dir = t.TempDir()
	cfg := filepath.Join(dir, "rblkd.yaml")
	listen := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	y := fmt.Sprintf("transport: tcp\nlisten: %s\nexports:\n  - name: gone\n    path: %s\n  - name: fresh\n    path: %s\n    size: 4M\n",
		listen, filepath.Join(dir, "no-such-dir", "gone.img"), filepath.Join(dir, "fresh.img"))
	if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	checks, r = runDoctor(t, rblkdBin, "--config", cfg, "--cache-size", "16M")
	if c := findCheck(t, checks, "listen "+listen); !c.OK {
		t.Errorf("--config's listen %s: %+v", listen, c)
	}
	if got := neededFailures(checks); r.code != 1 || len(got) != 1 || !strings.HasPrefix(got[0], "export gone:") {
		t.Errorf("--config with a missing backing file: exit %d, needed failures %q; want 1, only export gone", r.code, got)
	}
	if c := findCheck(t, checks, "export fresh"); !c.OK {
		t.Errorf("--config's export fresh (size given, rblkd creates it): %+v", c)
	}
	for _, c := range checks {
		if strings.HasPrefix(c.Name, "rdma") {
			t.Errorf("--config says transport tcp, but doctor checked %q", c.Name)
		}
	}
	if err := os.WriteFile(cfg, []byte("exports:\n  - name: a\n    pth: x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	wantCLIError(t, rblkdBin, []string{cfg + ":3: exports[0].pth"}, "doctor", "--config", cfg)

	// Bad flags are refused in one line.
	wantCLIError(t, attachBin, []string{"--device", "nbd, ublk or none"}, "doctor", "--device", "floppy")
	wantCLIError(t, rblkdBin, []string{"--transport", "tcp, rdma or auto"}, "doctor", "--transport", "carrier-pigeon")
}
