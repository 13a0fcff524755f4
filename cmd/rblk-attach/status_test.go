package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/rblk/rblk/internal/attachstate"
)

func TestParseBackend(t *testing.T) {
	for _, c := range []struct {
		in, target, export string
		ok                 bool
	}{
		{"rblk:vol0@10.0.0.1:7480\n", "10.0.0.1:7480", "vol0", true},
		{"rblk:a@b@[fe80::1]:7480", "[fe80::1]:7480", "a@b", true},
		{"rblk", "", "", false},
		{"rblk:vol0", "", "", false},
		{"rblk:@host:1", "", "", false},
		{"rblk:vol0@", "", "", false},
		{"qemu-nbd:vol0@host", "", "", false},
	} {
		target, export, ok := parseBackend(c.in)
		if target != c.target || export != c.export || ok != c.ok {
			t.Errorf("parseBackend(%q) = %q, %q, %v; want %q, %q, %v", c.in, target, export, ok, c.target, c.export, c.ok)
		}
	}
}

func TestUdevName(t *testing.T) {
	for in, want := range map[string]string{
		"10.0.0.1:7480":   "10.0.0.1:7480",
		"[fe80::1]:7480":  "_fe80::1_:7480",
		"pool/vol 1":      "pool_vol_1",
		"..":              "__",
		".":               "_",
		"":                "_",
		"db-01.example:1": "db-01.example:1",
		"é":               "__",
	} {
		if got := udevName(in); got != want {
			t.Errorf("udevName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestUdevIDRefuses(t *testing.T) {
	if _, _, err := udevID("sda", t.TempDir()); err == nil {
		t.Error("udev-id sda succeeded")
	}
	// nbd99 does not exist here, or is not rblk's.
	if _, _, err := udevID("nbd99", t.TempDir()); !errors.Is(err, errNotRblk) {
		t.Errorf("udev-id nbd99: %v, want errNotRblk", err)
	}
}

// TestPrintStatusIdentity: the table shows each attach's host ID and
// instance (two attaches of one host and export differ by the instance),
// and a dash for a file of an older rblk-attach without them.
func TestPrintStatusIdentity(t *testing.T) {
	var out bytes.Buffer
	es := []attachstate.Entry{
		{PID: 10, Socket: "unix:/a.sock", Export: "vol", Target: "t:1", Transport: "tcp", State: attachstate.Up, Since: time.Now(),
			HostID: "host-1", Instance: "0123456789abcdef"},
		{PID: 11, Socket: "unix:/b.sock", Export: "vol", Target: "t:1", Transport: "tcp", State: attachstate.Up, Since: time.Now()},
	}
	if err := printStatus(&out, es); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "HOST ID") || !strings.Contains(lines[0], "INSTANCE") {
		t.Fatalf("status table:\n%s", out.String())
	}
	if f := strings.Fields(lines[1]); f[len(f)-2] != "host-1" || f[len(f)-1] != "0123456789abcdef" {
		t.Errorf("row of an attach: %q, want its host ID and instance last", lines[1])
	}
	if f := strings.Fields(lines[2]); f[len(f)-2] != "-" || f[len(f)-1] != "-" {
		t.Errorf("row of an older attach: %q, want dashes", lines[2])
	}
}
