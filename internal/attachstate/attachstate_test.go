package attachstate

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

func TestRecordLifecycle(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "attach")
	r, err := Create(dir, Entry{Export: "vol0", Target: "127.0.0.1:7480", Transport: "tcp", State: Connecting, Queues: 2,
		HostID: "host-1", Instance: "00c0ffee00c0ffee"})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, strconv.Itoa(os.Getpid())+".json"); r.Path() != want {
		t.Errorf("status file %s, want %s", r.Path(), want)
	}
	since := r.Entry().Since
	if err := r.Update(func(e *Entry) { e.State = Up; e.Socket = "unix:/run/x.sock" }); err != nil {
		t.Fatal(err)
	}
	got, err := List(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 {
		t.Fatalf("List: %d entries, want 1: %+v", len(got), got)
	}
	e := got[0]
	if e.PID != os.Getpid() || e.State != Up || e.Export != "vol0" || e.Socket != "unix:/run/x.sock" || e.Queues != 2 || e.Since.Before(since) ||
		e.HostID != "host-1" || e.Instance != "00c0ffee00c0ffee" {
		t.Errorf("List: %+v", e)
	}
	// The file is JSON with snake_case keys.
	b, err := os.ReadFile(r.Path())
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("status file: %v\n%s", err, b)
	}
	for _, k := range []string{"pid", "socket", "export", "target", "transport", "state", "reconnects", "since", "queues", "host_id", "instance"} {
		if _, ok := m[k]; !ok {
			t.Errorf("status file has no %q: %s", k, b)
		}
	}
	// No temporary files are left behind.
	des, _ := os.ReadDir(dir)
	if len(des) != 1 {
		t.Errorf("status folder holds %d files, want 1", len(des))
	}
	if err := r.Remove(); err != nil {
		t.Fatal(err)
	}
	if err := r.Update(func(e *Entry) { e.State = Draining }); err != nil {
		t.Fatal(err)
	}
	if got, _ := List(dir); len(got) != 0 {
		t.Errorf("after Remove (and an Update): %+v, want nothing", got)
	}
}

func TestStaleFiles(t *testing.T) {
	dir := t.TempDir()
	// A process that has exited.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead := cmd.Process.Pid
	writeEntry(t, dir, Entry{PID: dead, Export: "dead", StartTicks: 1})
	// A live pid (this process) whose start time differs: a reused pid.
	me, err := startTicks(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	writeEntry(t, dir, Entry{PID: os.Getpid(), Export: "reused", StartTicks: me + 1})
	// Not ours: left alone.
	os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("x"), 0o644)

	got, err := List(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 0 {
		t.Errorf("List: %+v, want the stale entries skipped", got)
	}
	for _, pid := range []int{dead, os.Getpid()} {
		if _, err := os.Stat(filepath.Join(dir, strconv.Itoa(pid)+".json")); !os.IsNotExist(err) {
			t.Errorf("stale file of pid %d not removed: %v", pid, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "notes.txt")); err != nil {
		t.Errorf("List removed a file that is not a status file: %v", err)
	}
	if got, err := List(filepath.Join(dir, "missing")); err != nil || got != nil {
		t.Errorf("List of a missing folder: %v, %v; want nothing, nil", got, err)
	}
}

func writeEntry(t *testing.T, dir string, e Entry) {
	t.Helper()
	b, _ := json.Marshal(e)
	if err := os.WriteFile(filepath.Join(dir, strconv.Itoa(e.PID)+".json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
}
