//go:build linux && cgo && rdma

package verbs

import "testing"

// TestABIStrings: the Go tables of device.go say what the libraries say.
func TestABIStrings(t *testing.T) {
	for st := range uint32(len(statusText) + 2) {
		if got, want := StatusString(st), cStatusString(st); st < uint32(len(statusText)) && got != want {
			t.Errorf("StatusString(%d) = %q, ibv_wc_status_str %q", st, got, want)
		}
	}
	for ev := range EventType(len(eventText)) {
		if got, want := ev.String(), cEventString(ev); got != want {
			t.Errorf("EventType(%d) = %q, rdma_event_str %q", int(ev), got, want)
		}
	}
	for _, k := range []uint32{0, 1, 0xff, 0x100, 0x12345678, 0xfffffffe, 0xffffffff} {
		if got, want := IncRKey(k), cIncRKey(k); got != want {
			t.Errorf("IncRKey(%#x) = %#x, ibv_inc_rkey %#x", k, got, want)
		}
	}
}
