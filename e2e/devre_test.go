package e2e

import "testing"

// TestDeviceFromAttachedLine: startAttach takes the device from rblk-attach's
// "attached" line, never from the kernel package's "nbd device attached"
// (Attach may detach and attach again after it).
func TestDeviceFromAttachedLine(t *testing.T) {
	good := "2026-11-27T14:22:24.070Z\tINFO\trblk-attach/device.go:101\tattached\t{\"device\": \"/dev/nbd0\", \"export\": \"k\"}"
	bad := "2026-11-27T14:24:19.485Z\tINFO\tkernel/device.go:284\tnbd device attached\t{\"device\": \"/dev/nbd6\", \"export\": \"vol\"}"
	if m := devRE.FindStringSubmatch(good); m == nil || m[1] != "/dev/nbd0" {
		t.Fatalf("the attached line: device %q, want /dev/nbd0", m)
	}
	if m := devRE.FindStringSubmatch(bad); m != nil {
		t.Fatalf("the kernel package's line matched: %q", m)
	}
}
