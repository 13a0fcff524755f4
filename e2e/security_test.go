package e2e

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Secrets of the security tests' hosts: never seen in any output.
const (
	e2eSecretA = "e2e-secret-of-host-a-7f3c9b2e41d8"
	e2eSecretB = "e2e-secret-of-host-b-0a6d58c3e917"
)

// writeFile writes a file of mode perm in dir.
func writeFile(t *testing.T, dir, name, content string, perm os.FileMode) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), perm); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, perm); err != nil { // past the umask
		t.Fatal(err)
	}
	return p
}

// authFiles writes an auth file for host-a and host-b and each host's
// secret file.
func authFiles(t *testing.T) (authFile, secretA, secretB string) {
	dir := t.TempDir()
	authFile = writeFile(t, dir, "auth", "# host secret\nhost-a "+e2eSecretA+"\n\nhost-b "+e2eSecretB+"\n", 0o600)
	secretA = writeFile(t, dir, "a.secret", e2eSecretA+"\n", 0o600)
	secretB = writeFile(t, dir, "b.secret", e2eSecretB+"\n", 0o600)
	return
}

// noSecrets fails t if a secret shows in any of the outputs.
func noSecrets(t *testing.T, outputs ...string) {
	t.Helper()
	for _, o := range outputs {
		for _, s := range []string{e2eSecretA, e2eSecretB} {
			if strings.Contains(o, s) {
				t.Fatalf("a secret appears in the output:\n%s", o)
			}
		}
	}
}

// TestAuthFilePermissions: rblkd and rblk-attach refuse secret files that
// group or others may read, and say why.
func TestAuthFilePermissions(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	img := writeFile(t, dir, "vol.img", strings.Repeat("\x00", 1<<20), 0o600)
	loose := writeFile(t, dir, "auth", "host-a "+e2eSecretA+"\n", 0o644)
	wantCLIError(t, rblkdBin, []string{"--auth-file", "readable by group or others", "chmod 600"},
		"serve", "--transport", e2eTransport(), "--listen", hostPort(freePort(t)), "--export", "vol="+img, "--auth-file", loose)
	looseSecret := writeFile(t, dir, "a.secret", e2eSecretA, 0o640)
	wantCLIError(t, attachBin, []string{"--secret-file", "readable by group or others"},
		"attach", "--host-id", "host-a", "--secret-file", looseSecret, "--transport", e2eTransport(), "--target", hostPort(1), "--export", "vol",
		"--nbd-listen", "unix:"+filepath.Join(sockDir(t), "nbd.sock"))
	wantCLIError(t, attachBin, []string{"--secret-file", "readable by group or others"},
		"list", "--host-id", "host-a", "--secret-file", looseSecret, "--transport", e2eTransport(), "--target", hostPort(1))
}

// TestUnauthenticatedOnlyOnLoopback: without --auth-file rblkd serves only
// loopback addresses, unless --allow-unauthenticated, which it warns of.
func TestUnauthenticatedOnlyOnLoopback(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	img := writeFile(t, dir, "vol.img", strings.Repeat("\x00", 1<<20), 0o600)
	wildcard := fmt.Sprintf("0.0.0.0:%d", freePort(t))
	wantCLIError(t, rblkdBin, []string{"not a loopback address", "--auth-file", "--allow-unauthenticated"},
		"serve", "--transport", e2eTransport(), "--listen", wildcard, "--export", "vol="+img)
	tg := startTargetOn(t, wildcard, []string{"vol=" + img}, "--allow-unauthenticated")
	if !strings.Contains(tg.out.String(), "WITHOUT authentication") {
		t.Fatalf("rblkd --allow-unauthenticated did not warn:\n%s", tg.out.String())
	}
	tg.stop(t, stopTimeout)
}

// TestAuthentication: the right host and secret attach and list; a wrong
// secret, an unknown host, a missing secret and a host not on the export's
// allow list are refused at once with one clear line on both sides, counted
// in rblkd's metrics; no secret appears in any output.
func TestAuthentication(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	authFile, secretA, secretB := authFiles(t)
	dir := t.TempDir()
	tg := startTarget(t, []string{"vol=" + filepath.Join(dir, "vol.img") + ",size=4M,allow=host-a",
		"open=" + filepath.Join(dir, "open.img") + ",size=4M"}, "--auth-file", authFile, "--target-id", "e2e-target")

	at := startAttach(t, tg, "vol", "--host-id", "host-a", "--secret-file", secretA)
	qemuIO(t, at.uri("vol"), []qop{{kind: 'w', pattern: 0x5a, n: 64 << 10}, {kind: 'r', pattern: 0x5a, n: 64 << 10}})
	r := mustRun(t, 30*time.Second, attachBin, "list", "--host-id", "host-b", "--secret-file", secretB, "--transport", e2eTransport(), "--target", tg.addr)
	if !strings.Contains(r.stdout, "open") || strings.Contains(r.stdout, "vol ") {
		t.Errorf("host-b's list shows %q: want open, not vol (allow=host-a)", r.stdout)
	}

	sock := "unix:" + filepath.Join(sockDir(t), "nbd.sock")
	attach := func(host string, more ...string) []string {
		return append([]string{"attach", "--host-id", host, "--transport", e2eTransport(), "--target", tg.addr, "--export", "vol", "--nbd-listen", sock}, more...)
	}
	for _, c := range []struct {
		name   string
		args   []string
		reason string
		wants  []string
	}{
		{"wrong secret", attach("host-a", "--secret-file", secretB), "wrong_secret", []string{"authentication", `wrong secret for host "host-a"`}},
		{"unknown host", attach("host-z", "--secret-file", secretA), "unknown_host", []string{"authentication", `unknown host "host-z"`}},
		{"missing secret", attach("host-a"), "no_secret", []string{"authentication", "gave no secret", "--secret-file"}},
		{"list with a wrong secret", []string{"list", "--host-id", "host-b", "--secret-file", secretA, "--transport", e2eTransport(), "--target", tg.addr},
			"wrong_secret", []string{"authentication", `wrong secret for host "host-b"`}},
	} {
		before, _ := metricSum(scrape(t, tg.metrics), "rblkd_auth_failures_total", `reason="`+c.reason+`"`)
		logBefore := strings.Count(tg.out.String(), "authentication refused")
		wantCLIError(t, attachBin, c.wants, c.args...)
		if v := metric(t, tg.metrics, "rblkd_auth_failures_total", `reason="`+c.reason+`"`); v != before+1 {
			t.Errorf("%s: rblkd_auth_failures_total{reason=%q} = %v, want %v", c.name, c.reason, v, before+1)
		}
		if n := strings.Count(tg.out.String(), "authentication refused"); n != logBefore+1 {
			t.Errorf("%s: rblkd logged %d refusals, want one", c.name, n-logBefore)
		}
	}
	wantCLIError(t, attachBin, []string{`host "host-b" is not allowed to open export "vol"`}, attach("host-b", "--secret-file", secretB)...)
	if v := metric(t, tg.metrics, "rblkd_refused_total", `reason="not_allowed"`); v != 1 {
		t.Errorf("rblkd_refused_total{reason=\"not_allowed\"} = %v", v)
	}
	// The attached host went on through all that.
	qemuIO(t, at.uri("vol"), []qop{{kind: 'r', pattern: 0x5a, n: 64 << 10}})
	at.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	logs := tg.out.String() + at.out.String()
	if !strings.Contains(tg.out.String(), "authentication refused") || !strings.Contains(tg.out.String(), `"reason": "wrong_secret"`) {
		t.Errorf("rblkd's log does not name the refusals:\n%s", tg.out.String())
	}
	noSecrets(t, logs, r.stdout, r.stderr)
}

// TestOneWriterAndTakeover: a second writing host is refused, naming the
// holder; a takeover while the holder runs fio fences it (its IO fails,
// rblk-attach exits saying it was fenced), and the file then holds only
// what the new holder wrote. A shared export takes two writers.
func TestOneWriterAndTakeover(t *testing.T) {
	t.Parallel()
	needTools(t, "fio", "qemu-io")
	const size = 8 << 20
	dir := t.TempDir()
	backing := filepath.Join(dir, "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + fmt.Sprintf(",size=%d", size), "shared=" + filepath.Join(dir, "shared.img") + ",size=4M,shared"},
		"--chunk-size", "64K")

	a := startAttach(t, tg, "vol", "--host-id", "host-a", "--reconnect-timeout", "30s")
	fio := startFio(t, append(append([]string{"--name=holder"}, fioTarget(a.uri("vol"))...), "--rw=randwrite", "--bs=4k", "--iodepth=8",
		"--size="+fmt.Sprint(size), "--time_based", "--runtime=60", "--buffer_pattern=0x41")...)
	waitMetric(t, tg.metrics, "rblkd_written_bytes_total", func(v float64) bool { return v >= 1<<20 }, ">= 1 MiB written by the holder")

	sock := "unix:" + filepath.Join(sockDir(t), "nbd.sock")
	wantCLIError(t, attachBin, []string{`export "vol" is held read-write by host "host-a"`, "--takeover"},
		"attach", "--host-id", "host-b", "--transport", e2eTransport(), "--target", tg.addr, "--export", "vol", "--nbd-listen", sock)
	ro := startAttach(t, tg, "vol", "--host-id", "host-r", "--read-only")
	ro.stop(t, stopTimeout)

	b := startAttach(t, tg, "vol", "--host-id", "host-b", "--takeover")
	// The old holder is fenced: its rblk-attach ends, its IO fails.
	select {
	case <-a.done:
	case <-time.After(patient(30 * time.Second)):
		t.Fatal("the fenced holder's rblk-attach is still running")
	}
	if a.waitErr == nil || !strings.Contains(a.out.String(), "fenced") || !strings.Contains(a.out.String(), `host "host-b" took export "vol" over`) {
		t.Fatalf("the fenced rblk-attach: %v\n%s", a.waitErr, a.out.String())
	}
	<-fio.done
	if fio.r.code == 0 && fio.err == nil {
		t.Fatalf("fio on the fenced holder succeeded:\n%s", fio.r)
	}
	if v := metric(t, tg.metrics, "rblkd_takeovers_total"); v != 1 {
		t.Errorf("rblkd_takeovers_total = %v", v)
	}
	mustRun(t, 2*time.Minute, "qemu-io", "-f", "raw", "-c", fmt.Sprintf("write -P 0x42 0 %d", size), "-c", "flush", b.uri("vol"))
	b.stop(t, stopTimeout)

	// Two writers of a shared export.
	s1 := startAttach(t, tg, "shared", "--host-id", "host-a")
	s2 := startAttach(t, tg, "shared", "--host-id", "host-b")
	mustRun(t, time.Minute, "qemu-io", "-f", "raw", "-c", "write -P 0x61 0 1M", "-c", "flush", s1.uri("shared"))
	mustRun(t, time.Minute, "qemu-io", "-f", "raw", "-c", "write -P 0x62 1M 1M", "-c", "flush", s2.uri("shared"))
	s1.stop(t, stopTimeout)
	s2.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)

	file, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if i := bytes.IndexFunc(file, func(r rune) bool { return r != 0x42 }); i >= 0 {
		t.Fatalf("the file holds a byte %#x at %d not written by the new holder: the fenced holder's write landed", file[i], i)
	}
	shared, _ := os.ReadFile(filepath.Join(dir, "shared.img"))
	if !bytes.Equal(shared[:1<<20], bytes.Repeat([]byte{0x61}, 1<<20)) || !bytes.Equal(shared[1<<20:2<<20], bytes.Repeat([]byte{0x62}, 1<<20)) {
		t.Fatal("the shared export does not hold both writers' data")
	}
}
