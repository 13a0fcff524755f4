package auth_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport/tcp"
)

var (
	ci = func() (c [32]byte) {
		for i := range c {
			c[i] = byte(i)
		}
		return
	}()
	ct     = [32]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	secret = []byte("0123456789abcdef")
)

// TestProofGolden pins the proof's construction (computed independently
// with Python's hmac module), so that both sides of any version agree.
func TestProofGolden(t *testing.T) {
	for role, want := range map[string]string{
		auth.RoleInitiator: "8af7db2f7db84f427c9f1ab57f1507987450e3f74de4c634bd4e4bc3aefe0a83",
		auth.RoleTarget:    "be439672270be8e7dea424d67795dbc6e0c679ffa097656ec148bc898d46a161",
	} {
		p := auth.Proof(secret, role, "host-a", "tgt", &ci, &ct)
		if got := hex.EncodeToString(p[:]); got != want {
			t.Errorf("Proof(%s) = %s, want %s", role, got, want)
		}
	}
}

// TestProofBindsEverything: changing any input changes the proof, so an
// answer cannot be reflected (role), replayed (challenges) or moved to
// another host or target (identities); identities are length-prefixed, so
// moving bytes from one to the other changes it too.
func TestProofBindsEverything(t *testing.T) {
	base := auth.Proof(secret, auth.RoleInitiator, "host-a", "tgt", &ci, &ct)
	ci2, ct2 := ci, ct
	ci2[0] ^= 1
	ct2[31] ^= 1
	for name, p := range map[string][32]byte{
		"role":       auth.Proof(secret, auth.RoleTarget, "host-a", "tgt", &ci, &ct),
		"host":       auth.Proof(secret, auth.RoleInitiator, "host-b", "tgt", &ci, &ct),
		"target":     auth.Proof(secret, auth.RoleInitiator, "host-a", "tgx", &ci, &ct),
		"boundary":   auth.Proof(secret, auth.RoleInitiator, "host-at", "gt", &ci, &ct),
		"challenge":  auth.Proof(secret, auth.RoleInitiator, "host-a", "tgt", &ci2, &ct),
		"challenge2": auth.Proof(secret, auth.RoleInitiator, "host-a", "tgt", &ci, &ct2),
		"swapped":    auth.Proof(secret, auth.RoleInitiator, "host-a", "tgt", &ct, &ci),
		"secret":     auth.Proof([]byte("0123456789abcdeF"), auth.RoleInitiator, "host-a", "tgt", &ci, &ct),
	} {
		if auth.Equal(&p, &base) {
			t.Errorf("changing the %s leaves the proof unchanged", name)
		}
	}
}

func write(t *testing.T, content string, perm os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte(content), perm); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, perm); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadKeys(t *testing.T) {
	const s1, s2 = "aaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbbbbbb"
	k, err := auth.LoadKeys(write(t, "# comment\nhost-a "+s1+"\n\n  host-b\t"+s2+"  \n", 0o600))
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := k.Secret("host-a"); !ok || string(got) != s1 {
		t.Errorf("host-a: %q %v", got, ok)
	}
	if got, ok := k.Secret("host-b"); !ok || string(got) != s2 {
		t.Errorf("host-b: %q %v", got, ok)
	}
	if _, ok := k.Secret("host-c"); ok || k.Len() != 2 {
		t.Error("unknown host found")
	}
	for _, c := range []struct {
		name, content string
		perm          os.FileMode
		want          string
	}{
		{"group readable", "host-a " + s1 + "\n", 0o640, "readable by group or others"},
		{"world readable", "host-a " + s1 + "\n", 0o604, "chmod 600"},
		{"three fields", "host-a " + s1 + " extra\n", 0o600, "line 1"},
		{"short secret", "host-a short\n", 0o600, "want 16 to 1024"},
		{"twice", "host-a " + s1 + "\nhost-a " + s2 + "\n", 0o600, `host "host-a" given twice`},
		{"empty", "# nobody\n", 0o600, "no hosts"},
	} {
		_, err := auth.LoadKeys(write(t, c.content, c.perm))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.want)
			continue
		}
		for _, s := range []string{s1, s2, "short"} {
			if strings.Contains(err.Error(), s) {
				t.Errorf("%s: the error shows a secret: %v", c.name, err)
			}
		}
	}
	if _, err := auth.LoadKeys(write(t, "host-a "+s1, 0o644)); !errors.Is(err, auth.ErrInsecureFile) {
		t.Errorf("insecure file: %v", err)
	}
}

func TestReadSecret(t *testing.T) {
	s, err := auth.ReadSecret(write(t, "  0123456789abcdef0123\n", 0o400))
	if err != nil || string(s) != "0123456789abcdef0123" {
		t.Fatalf("%q, %v", s, err)
	}
	if _, err := auth.ReadSecret(write(t, "0123456789abcdef0123\n", 0o644)); !errors.Is(err, auth.ErrInsecureFile) {
		t.Errorf("0644: %v", err)
	}
	if _, err := auth.ReadSecret(write(t, "0123456789abcdef 0123\n", 0o600)); err == nil || strings.Contains(err.Error(), "0123456789") {
		t.Errorf("two words: %v", err)
	}
	if _, err := auth.ReadSecret(write(t, "tooshort", 0o600)); err == nil {
		t.Error("short secret accepted")
	}
}

// rogueTarget accepts one connection and answers the exchange as a
// target that does not know the secret, or does not authenticate.
func rogueTarget(t *testing.T, required bool) string {
	t.Helper()
	p := tcp.New("tcp")
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ln, err := p.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		req, err := ln.Accept(ctx)
		if err != nil {
			return
		}
		var l *link.Link
		ready := make(chan struct{})
		l, err = link.Accept(ctx, req, link.Options{Handler: func(h protocol.Header, b []byte) {
			<-ready
			var reply protocol.Message
			switch h.Type {
			case protocol.TypeAuthStart:
				ch := &protocol.AuthChallenge{TargetID: "rogue", Challenge: ct}
				if required {
					ch.Flags = protocol.AuthRequired
				}
				reply = ch
			case protocol.TypeAuthResponse:
				reply = &protocol.AuthAccept{Proof: [32]byte{1, 2, 3}}
			default:
				return
			}
			go l.Send(ctx, h.Tag, reply)
		}})
		if err != nil {
			return
		}
		close(ready)
		t.Cleanup(func() { l.Close() })
	}()
	return ln.Addr()
}

func TestInitiateRefusesRogueTargets(t *testing.T) {
	for _, c := range []struct {
		name     string
		required bool
		want     string
	}{
		{"wrong proof", true, `target "rogue" did not prove it knows host "host-a"'s secret`},
		{"no authentication", false, `target "rogue" does not authenticate`},
	} {
		t.Run(c.name, func(t *testing.T) {
			addr := rogueTarget(t, c.required)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			l, err := link.Dial(ctx, tcp.New("tcp"), addr, link.Options{Handler: func(protocol.Header, []byte) {}})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			_, err = auth.Initiate(ctx, l, "host-a", secret)
			if !errors.Is(err, auth.ErrFailed) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want %q", err, c.want)
			}
			if bytes.Contains([]byte(err.Error()), secret) {
				t.Fatal("the error shows the secret")
			}
		})
	}
}

// TestFilesNotRegular: an auth file or a secret file that is a FIFO (read
// as it was, it would block for ever, waiting for a writer), a socket or a
// directory is refused at once, naming the path and what it is.
func TestFilesNotRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for path, kind := range map[string]string{fifo: "a FIFO", sock: "a socket", dir: "a directory"} {
		for what, read := range map[string]func(string) error{
			"auth file":   func(p string) error { _, err := auth.LoadKeys(p); return err },
			"secret file": func(p string) error { _, err := auth.ReadSecret(p); return err },
		} {
			done := make(chan error, 1)
			go func() { done <- read(path) }()
			select {
			case err := <-done:
				if want := what + ": " + path + " is " + kind + ": want a regular file"; err == nil || err.Error() != want {
					t.Errorf("%s that is %s: %v, want %q", what, kind, err, want)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("%s that is %s: blocked", what, kind)
			}
		}
	}
}
