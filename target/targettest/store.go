// Package targettest has fault injectors for tests of the target: a backing
// store that is slow and that models a disk's volatile write cache, so that
// a test can ask what a crash at any moment would have left on disk.
package targettest

import (
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/rblk/rblk/target"
)

// DiskStore is a target.Store in front of a backing file that models a disk
// with a volatile write cache: WriteAt reaches the file (so reads see it) but
// counts as durable only once a later Sync returned. Durable returns the
// image a power loss would leave. WriteDelay and SyncDelay make it slow.
type DiskStore struct {
	f *os.File

	mu         sync.Mutex
	writeDelay time.Duration
	syncDelay  time.Duration
	durable    []byte
	pending    []write // written, not yet synced
	writes     int
	syncs      int
	failWrites error
}

type write struct {
	off  int64
	data []byte
}

var (
	_ target.Store          = (*DiskStore)(nil)
	_ target.VectorWriterAt = (*DiskStore)(nil)
)

// NewDiskStore wraps f, whose current content counts as durable.
func NewDiskStore(f *os.File) (*DiskStore, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("disk store: %w", err)
	}
	img := make([]byte, st.Size())
	if _, err := f.ReadAt(img, 0); err != nil {
		return nil, fmt.Errorf("disk store: read %s: %w", f.Name(), err)
	}
	return &DiskStore{f: f, durable: img}, nil
}

// SetDelays sets how long each WriteAt and each Sync takes.
func (d *DiskStore) SetDelays(write, sync time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.writeDelay, d.syncDelay = write, sync
}

// FailWrites makes every later WriteAt fail with err (nil: succeed again).
func (d *DiskStore) FailWrites(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.failWrites = err
}

// ReadAt reads the file.
func (d *DiskStore) ReadAt(p []byte, off int64) (int, error) { return d.f.ReadAt(p, off) }

// WriteAt waits the write delay, then writes p to the file and to the
// volatile cache.
func (d *DiskStore) WriteAt(p []byte, off int64) (int, error) {
	d.mu.Lock()
	delay, fail := d.writeDelay, d.failWrites
	d.mu.Unlock()
	time.Sleep(delay) // the slow disk itself, not synchronization
	if fail != nil {
		return 0, fail
	}
	n, err := d.f.WriteAt(p, off)
	d.mu.Lock()
	d.pending = append(d.pending, write{off, append([]byte(nil), p[:n]...)})
	d.writes++
	d.mu.Unlock()
	return n, err
}

// WriteVAt is the vectored write (pwritev) of the target's write-back: one
// write of the disk, as WriteAt of the concatenation of bufs would be (one
// write delay, one write counted), which reaches the file buffer by buffer.
func (d *DiskStore) WriteVAt(bufs [][]byte, off int64) (int, error) {
	d.mu.Lock()
	delay, fail := d.writeDelay, d.failWrites
	d.mu.Unlock()
	time.Sleep(delay)
	if fail != nil {
		return 0, fail
	}
	var data []byte
	var err error
	for _, b := range bufs {
		var n int
		n, err = d.f.WriteAt(b, off+int64(len(data)))
		data = append(data, b[:n]...)
		if err != nil {
			break
		}
	}
	d.mu.Lock()
	d.pending = append(d.pending, write{off, data})
	d.writes++
	d.mu.Unlock()
	return len(data), err
}

// Sync makes the writes that returned before it durable, after the sync
// delay.
func (d *DiskStore) Sync() error {
	d.mu.Lock()
	n := len(d.pending)
	delay := d.syncDelay
	d.mu.Unlock()
	time.Sleep(delay)
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, w := range d.pending[:n] {
		copy(d.durable[w.off:], w.data)
	}
	d.pending = append(d.pending[:0], d.pending[n:]...)
	d.syncs++
	return nil
}

// Fd is the file's descriptor.
func (d *DiskStore) Fd() uintptr { return d.f.Fd() }

// Durable returns a copy of [off, off+n) as a crash now would leave it.
func (d *DiskStore) Durable(off, n int64) []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]byte(nil), d.durable[off:off+n]...)
}

// Counts returns the number of writes and syncs so far.
func (d *DiskStore) Counts() (writes, syncs int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.writes, d.syncs
}
