package main

import (
	"errors"
	"testing"
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
