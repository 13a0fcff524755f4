package nbd

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// memBackend is the storage of the tests: a []byte behind a lock, buffers
// made of slots from a bounded pool (slots of an odd size, so that a buffer
// is several segments whose limits fall anywhere), a flush counter, error
// injection by range, and hooks to hold requests in flight.
type memBackend struct {
	mu   sync.RWMutex
	data []byte

	slot     int
	slots    chan []byte // free slots; its capacity bounds the pool
	allocMu  sync.Mutex  // one Alloc at a time takes slots, so Allocs cannot starve each other
	freeBufs []*Buffer   // Buffer structs for reuse (under allocMu)
	lent     atomic.Int64

	delay time.Duration // added to every ReadAt and WriteAt

	flushes, trims, zeroes, writes, reads atomic.Int64
	fuaWrites, noHoleZeroes               atomic.Int64
	cur, peak                             atomic.Int64 // ReadAt/WriteAt running at once

	errMu sync.Mutex
	errs  []injected

	// hook, when set, runs at the start of every ReadAt and WriteAt.
	hook atomic.Pointer[func(op string, off uint64)]
}

type injected struct {
	op          string // "read" or "write"
	off, length uint64
	err         error
}

// newMemBackend makes a backend of size bytes whose pool holds nslots slots
// of slot bytes; the bytes start as pattern(i).
func newMemBackend(size uint64, slot, nslots int) *memBackend {
	m := &memBackend{data: make([]byte, size), slot: slot, slots: make(chan []byte, nslots)}
	for i := range m.data {
		m.data[i] = pattern(i)
	}
	for i := 0; i < nslots; i++ {
		m.slots <- make([]byte, slot)
	}
	return m
}

// pattern is the initial content of byte i of a memBackend.
func pattern(i int) byte { return byte(i*7 + i/251) }

func (m *memBackend) Alloc(ctx context.Context, n int) (*Buffer, error) {
	m.allocMu.Lock()
	defer m.allocMu.Unlock()
	var b *Buffer
	if k := len(m.freeBufs); k > 0 {
		b = m.freeBufs[k-1]
		m.freeBufs = m.freeBufs[:k-1]
	} else {
		b = &Buffer{}
	}
	b.Segs = b.Segs[:0]
	for left := n; left > 0; {
		select {
		case s := <-m.slots:
			k := min(left, len(s))
			b.Segs = append(b.Segs, s[:k])
			left -= k
		case <-ctx.Done():
			for _, s := range b.Segs {
				m.slots <- s[:cap(s)]
			}
			m.freeBufs = append(m.freeBufs, b)
			return nil, ctx.Err()
		}
	}
	m.lent.Add(1)
	return b, nil
}

func (m *memBackend) Free(b *Buffer) {
	for _, s := range b.Segs {
		m.slots <- s[:cap(s)]
	}
	m.lent.Add(-1)
	m.allocMu.Lock()
	m.freeBufs = append(m.freeBufs, b)
	m.allocMu.Unlock()
}

func (m *memBackend) injectError(op string, off, length uint64, err error) {
	m.errMu.Lock()
	defer m.errMu.Unlock()
	m.errs = append(m.errs, injected{op, off, length, err})
}

func (m *memBackend) injectedError(op string, off, length uint64) error {
	m.errMu.Lock()
	defer m.errMu.Unlock()
	for _, e := range m.errs {
		if e.op == op && off < e.off+e.length && e.off < off+length {
			return e.err
		}
	}
	return nil
}

func bufLen(b *Buffer) uint64 {
	var n uint64
	for _, s := range b.Segs {
		n += uint64(len(s))
	}
	return n
}

func (m *memBackend) enter(op string, off uint64) {
	if h := m.hook.Load(); h != nil {
		(*h)(op, off)
	}
	c := m.cur.Add(1)
	for {
		p := m.peak.Load()
		if c <= p || m.peak.CompareAndSwap(p, c) {
			break
		}
	}
	if m.delay > 0 {
		time.Sleep(m.delay)
	}
}

func (m *memBackend) ReadAt(ctx context.Context, b *Buffer, off uint64) error {
	m.enter("read", off)
	defer m.cur.Add(-1)
	m.reads.Add(1)
	if err := m.injectedError("read", off, bufLen(b)); err != nil {
		return err
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, s := range b.Segs {
		off += uint64(copy(s, m.data[off:]))
	}
	return nil
}

func (m *memBackend) WriteAt(ctx context.Context, b *Buffer, off uint64, fua bool) error {
	m.enter("write", off)
	defer m.cur.Add(-1)
	m.writes.Add(1)
	if fua {
		m.fuaWrites.Add(1)
	}
	if err := m.injectedError("write", off, bufLen(b)); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, s := range b.Segs {
		off += uint64(copy(m.data[off:], s))
	}
	return nil
}

func (m *memBackend) Flush(ctx context.Context) error {
	m.flushes.Add(1)
	return nil
}

func (m *memBackend) zero(off, length uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.data[off : off+length])
}

func (m *memBackend) Trim(ctx context.Context, off, length uint64, fua bool) error {
	m.trims.Add(1)
	m.zero(off, length)
	return nil
}

func (m *memBackend) WriteZeroes(ctx context.Context, off, length uint64, noHole, fua bool) error {
	m.zeroes.Add(1)
	if noHole {
		m.noHoleZeroes.Add(1)
	}
	m.zero(off, length)
	return nil
}

// snapshot copies the bytes.
func (m *memBackend) snapshot() []byte {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return append([]byte(nil), m.data...)
}

// initial returns the bytes a fresh backend of size bytes holds.
func initial(size int) []byte {
	b := make([]byte, size)
	for i := range b {
		b[i] = pattern(i)
	}
	return b
}

// checkBytes compares a backend with the expected bytes and reports the
// first difference.
func checkBytes(t *testing.T, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("backend is %d bytes, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			j := i
			for j < len(got) && got[j] != want[j] {
				j++
			}
			t.Fatalf("backend differs at [%d, %d): got %#02x…, want %#02x…", i, j, got[i], want[i])
		}
	}
}

// checkReturned checks that every buffer lent was given back.
func (m *memBackend) checkReturned(t *testing.T) {
	t.Helper()
	if n := m.lent.Load(); n != 0 {
		t.Errorf("%d buffers not returned to the backend", n)
	}
	if n := len(m.slots); n != cap(m.slots) {
		t.Errorf("%d of %d slots free", n, cap(m.slots))
	}
}
