package transport

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// Memory is a buffer allocated outside the Go heap with mmap, so that its
// address is stable and may be handed to hardware. Register spans of it with
// Conn.Register.
type Memory struct {
	mu  sync.Mutex
	buf []byte
}

// AllocMemory maps size bytes of anonymous, zeroed memory. If hugePages is
// true it asks for huge pages first and falls back to normal pages.
func AllocMemory(size int, hugePages bool) (*Memory, error) {
	if size <= 0 {
		return nil, fmt.Errorf("alloc memory: invalid size %d", size)
	}
	flags := unix.MAP_PRIVATE | unix.MAP_ANONYMOUS
	if hugePages {
		if b, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, flags|unix.MAP_HUGETLB); err == nil {
			return &Memory{buf: b}, nil
		}
	}
	b, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, flags)
	if err != nil {
		return nil, fmt.Errorf("alloc memory: mmap %d bytes: %w", size, err)
	}
	return &Memory{buf: b}, nil
}

// Bytes is the whole mapping. It is nil after Free.
func (m *Memory) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.buf
}

// Free unmaps the memory. Every region registered over it must have been
// deregistered first. Safe to call twice.
func (m *Memory) Free() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.buf == nil {
		return nil
	}
	err := unix.Munmap(m.buf)
	m.buf = nil
	if err != nil {
		return fmt.Errorf("free memory: %w", err)
	}
	return nil
}
