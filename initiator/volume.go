package initiator

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
)

// Defaults of Options.
const (
	DefaultPoolSize = 64 << 20
	// MaxRequest is the largest NBD request served, the limit the NBD
	// protocol asks clients to stay under.
	MaxRequest = 32 << 20
	// DefaultReconnectTimeout is how long IO waits for the target to come
	// back after the connection is lost.
	DefaultReconnectTimeout = 2 * time.Minute
	// DefaultKeepAlive is how long the link to the target may stay silent
	// before it is declared dead (probed after a third of it), as NVMe's
	// keep-alive timeout.
	DefaultKeepAlive = 15 * time.Second
	// DefaultIOTimeout bounds every request to the target but flushes: a
	// grant, an RDMA READ or WRITE, a trim.
	DefaultIOTimeout = 30 * time.Second
	// DefaultFlushTimeout bounds a flush (or FUA write), which waits for
	// the target's write-back to a possibly slow disk.
	DefaultFlushTimeout = 2 * time.Minute
)

// Options configure Open.
type Options struct {
	// Provider carries the connection; Target is its address.
	Provider transport.Provider
	Target   string
	// Export is the volume's name.
	Export string
	// HostID is this host's stable identity (see HostID in package
	// protocol). When the volume reconnects, the target fences its earlier
	// session (same host ID, export and Instance) before the new one does
	// IO. Another attach of the same host (another Instance) is refused
	// while this one is alive, unless it takes the export over. Empty:
	// anonymous, no fencing.
	HostID string
	// Instance names this attach beside HostID: the same on every
	// reconnect and queue of the volume, another for another attach (as
	// iSCSI's ISID beside the initiator name). Zero: Open makes one
	// (NewInstance). Sent to targets that know it (protocol.Open.Instance).
	Instance uint64
	// Secret, if set, is HostID's secret: the volume then authenticates
	// with the target, both ways, on every connection (see package auth),
	// and refuses a target that does not. Nil: the host only names itself.
	Secret []byte
	// Takeover, on a read-write open of an exclusive export that another
	// host holds, or that another live attach of this host holds, has the
	// target fence that session and hand the export over (only on the
	// first connection, never on a reconnect).
	Takeover bool
	// ReadOnly opens the volume for reading only.
	ReadOnly bool
	// Queues is the number of connections to the target, the session's IO
	// queues (default 1): each has its own completion path and grants, a
	// request goes to the queue of its first chunk, and a flush goes to
	// all. They need a HostID; the volume goes on with fewer if the target
	// takes fewer.
	Queues int
	// PoolSize is the registered memory for IO buffers (default
	// DefaultPoolSize); it bounds the bytes of requests in flight, and must
	// be at least MaxRequest.
	PoolSize int
	// ReconnectTimeout bounds how long the volume tries to reconnect after
	// the connection to the target is lost, while IO waits. Zero means
	// DefaultReconnectTimeout; negative means no reconnection.
	ReconnectTimeout time.Duration
	// FastFailTimeout, if positive, is how long IO waits for the target
	// once the connection is lost: after it, IO that waits and IO that
	// comes fail with EIO (ErrUnavailable) at once, while the volume goes
	// on reconnecting (for ReconnectTimeout); once it is back, IO is
	// served again. As NVMe's fast_io_fail_tmo: a mirror above (md RAID1)
	// fails the member within it instead of stalling its application, and
	// can re-add it later. Zero: IO waits as long as the volume
	// reconnects.
	FastFailTimeout time.Duration
	// RestartGrace, if longer than FastFailTimeout, takes its place after
	// a planned shutdown of the target (it drained this volume first: an
	// rblkd restarted with SIGTERM): IO waits that long for it to come
	// back before it fails fast, so that a planned restart degrades no
	// mirror.
	RestartGrace time.Duration
	// FailOnLostWrites: when the volume reconnects to another instance of
	// the target (it restarted) while writes acknowledged since the last
	// flush may not have reached its file, the volume fails for good
	// (ErrLostWrites) instead of reporting it at the next flush: a mirror
	// member that may have lost writes is taken out and resynced, never
	// rejoins as if whole.
	FailOnLostWrites bool
	// KeepAlive is how long the link may stay silent before it is taken
	// down and the reconnect path runs. Zero means DefaultKeepAlive;
	// negative disables it.
	KeepAlive time.Duration
	// IOTimeout bounds each request but flushes; FlushTimeout bounds
	// flushes and FUA writes. A request not answered in time takes the
	// link down (the reconnect path runs and the request is done again).
	// Zero means DefaultIOTimeout and DefaultFlushTimeout.
	IOTimeout    time.Duration
	FlushTimeout time.Duration
	// Logger gets one line per session event. Default: no logs.
	Logger *zap.Logger
	// Metrics, if not nil, are updated; see NewMetrics.
	Metrics *Metrics
	// OnResize, if set, is called when the volume grew on the target
	// (its Resize notice, or a larger size on a reconnection), after Size
	// reports the new size: a front end tells its device. Calls are made
	// one at a time, in order, on a goroutine of their own.
	OnResize func(oldSize, newSize uint64)
	// OnLink, if set, is called when the session's connection is lost
	// (up false) and when it is made again (up true, with the number of
	// reconnects so far): a status file or a dashboard follows the volume
	// with it. Calls come one at a time from the volume's supervising
	// goroutine; it must not block, and must not call the volume.
	OnLink func(up bool, reconnects int)
}

// Volume is an open remote volume. It implements blockdev.Backend: reads are
// RDMA READs from granted chunks of the target's memory, writes are RDMA
// WRITEs followed by a Done message.
//
// When the connection to the target is lost, the volume reconnects (for up
// to Options.ReconnectTimeout) while IO waits, and IO that was in flight is
// done again on the new connection. Writes the target acknowledged but had
// not made durable may have been lost with the target's memory; if there were
// any (writes since the last successful flush), the next Flush fails with EIO
// once, as a disk reports a lost volatile write cache.
type Volume struct {
	opts   Options
	log    *zap.Logger
	m      *Metrics
	info   protocol.VolumeInfo // of the first session: chunk size, flags
	size   atomic.Uint64       // bytes: the first session's, larger once the volume grew (resize.go)
	resize resizer
	mem    *transport.Memory
	pool   *bufPool

	// mu guards the volume's state; no IO takes it on its way (submit),
	// which takes its queue's (session.mu) alone. Lock order: mu before
	// a session's.
	mu      sync.Mutex
	set     atomic.Pointer[queueSet] // the session's queues; nil while reconnecting (stored with mu held)
	changed chan struct{}            // closed and replaced when set changes
	failed  error                    // set when the volume gave up or was closed
	dead    atomic.Bool              // failed is set: read by IO without mu
	done    chan struct{}            // closed with failed

	writes    atomic.Uint64 // writes acknowledged, counted while their session is held
	flushedAt uint64        // writes covered by the last successful flush (mu)
	lost      bool          // writes may have been lost with a session (mu)

	downs         uint64        // connections lost so far (mu): a fast-fail timer's generation
	fastFailing   bool          // IO fails at once while the target is away (mu)
	fastFailAfter time.Duration // how long IO waited before failing fast (mu)

	stop      chan struct{}
	superDone chan struct{}
	closeOnce sync.Once
	closeErr  error
}

var _ blockdev.Backend = (*Volume)(nil)

// ErrClosed is returned by IO on a closed volume.
var ErrClosed = errors.New("volume closed")

// ErrFenced is why a volume failed when the target fenced its session:
// another attach took the export over (another host, or another attach
// of this host with Takeover), or found this one dead (it did not answer
// the target's liveness check), or the target refused its reconnect for
// such a holder. Its IO fails from then on; it does not reconnect, which
// would fence the other session in turn.
var ErrFenced = errors.New("fenced")

// errHeld marks an Open refused because another host, or another attach
// of this host, holds the export read-write: on a reconnect, it took the
// export over.
type errHeld struct{ error }

func (e errHeld) Unwrap() error { return e.error }

// ErrLostWrites is returned by Flush once after a lost connection when
// writes acknowledged since the previous flush may not have reached the
// backing file.
var ErrLostWrites = errors.New("writes since the last flush may have been lost with the connection to the target")

// ErrUnavailable is why IO fails while the target has been unreachable
// for longer than Options.FastFailTimeout (the volume goes on
// reconnecting).
var ErrUnavailable = errors.New("the target is unreachable")

// Open connects to the target, opens the export and sets up the IO buffers.
func Open(ctx context.Context, opts Options) (*Volume, error) {
	if opts.PoolSize == 0 {
		opts.PoolSize = DefaultPoolSize
	}
	if opts.PoolSize < MaxRequest {
		return nil, fmt.Errorf("buffer pool of %d bytes: need at least %d", opts.PoolSize, MaxRequest)
	}
	if opts.ReconnectTimeout == 0 {
		opts.ReconnectTimeout = DefaultReconnectTimeout
	}
	if opts.KeepAlive == 0 {
		opts.KeepAlive = DefaultKeepAlive
	}
	if opts.IOTimeout <= 0 {
		opts.IOTimeout = DefaultIOTimeout
	}
	if opts.FlushTimeout <= 0 {
		opts.FlushTimeout = DefaultFlushTimeout
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Metrics == nil {
		opts.Metrics = NewMetrics(nil)
	}
	if opts.Instance == 0 {
		id, err := NewInstance()
		if err != nil {
			return nil, fmt.Errorf("open volume %q: %w", opts.Export, err)
		}
		opts.Instance = id
	}
	v := &Volume{opts: opts, log: opts.Logger, m: opts.Metrics, changed: make(chan struct{}),
		done: make(chan struct{}), stop: make(chan struct{}), superDone: make(chan struct{})}
	mem, err := transport.AllocMemory(opts.PoolSize, true) // huge pages where there are
	if err != nil {
		return nil, fmt.Errorf("open volume %q: IO buffers: %w", opts.Export, err)
	}
	v.mem = mem
	v.pool = newBufPool(mem.Bytes(), opts.Queues)
	s, err := v.connect(ctx, v.opts.Takeover)
	if err != nil {
		mem.Free()
		return nil, err
	}
	v.info = s.info
	v.grew(s.info.VolumeSize)
	set := v.join(ctx, s)
	v.set.Store(set)
	v.m.sessions.Set(1)
	transportInfo := opts.Provider.Name()
	if di, ok := s.link.Conn().(interface{ DeviceInfo() string }); ok {
		transportInfo += ": " + di.DeviceInfo() // device, port, GID, addresses
	}
	v.log.Info("volume opened", zap.String("export", opts.Export), zap.String("target", opts.Target),
		zap.String("host_id", opts.HostID), zap.String("instance", FormatInstance(opts.Instance)), zap.Bool("target_knows_instances", s.withInstance),
		zap.String("transport", transportInfo), zap.Uint64("size", v.info.VolumeSize),
		zap.Uint32("chunk_size", v.info.ChunkSize), zap.Bool("read_only", v.ReadOnly()),
		zap.String("io_buffers_huge_pages", v.mem.HugePages()), zap.Int("queues", len(set.qs)))
	go v.supervise(set)
	return v, nil
}

// NewInstance returns a new attach instance (Options.Instance): random,
// never 0.
func NewInstance() (uint64, error) {
	var b [8]byte
	for {
		if _, err := rand.Read(b[:]); err != nil {
			return 0, fmt.Errorf("attach instance: %w", err)
		}
		if id := binary.BigEndian.Uint64(b[:]); id != 0 {
			return id, nil
		}
	}
}

// FormatInstance writes an attach instance as logs, status and the
// target's messages show it: 16 hex digits.
func FormatInstance(id uint64) string { return fmt.Sprintf("%016x", id) }

// Instance is the volume's attach instance (Options.Instance).
func (v *Volume) Instance() uint64 { return v.opts.Instance }

// Size is the volume's size in bytes: it grows when the target grows the
// volume online (see Options.OnResize).
func (v *Volume) Size() uint64 { return v.size.Load() }

// ReadOnly reports whether writes are refused.
func (v *Volume) ReadOnly() bool {
	return v.opts.ReadOnly || v.info.Flags&protocol.VolReadOnly != 0
}

// Flags are the volume's capabilities as the target reports them.
func (v *Volume) Flags() protocol.VolumeFlags { return v.info.Flags }

// ChunkSize is the target's unit of granting.
func (v *Volume) ChunkSize() uint64 { return uint64(v.info.ChunkSize) }

// Done is closed when the volume is closed or gave up reconnecting.
func (v *Volume) Done() <-chan struct{} { return v.done }

// Err is why the volume ended (ErrClosed after Close), or nil.
func (v *Volume) Err() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.failed
}

// Close flushes (for a writable volume), closes the volume on the target
// and the connection. Safe to call twice.
func (v *Volume) Close(ctx context.Context) error {
	v.closeOnce.Do(func() {
		var errs []error
		v.mu.Lock()
		set, failed := v.set.Load(), v.failed
		v.mu.Unlock()
		if failed == nil && set != nil && set.up() {
			if !v.ReadOnly() {
				if err := v.Flush(ctx); err != nil {
					errs = append(errs, err)
				}
			}
			// The joined queues first: the first connection's Close ends
			// the session on the target.
			for i := len(set.qs) - 1; i >= 0; i-- {
				s := set.qs[i]
				if err := s.link.Request(ctx, &protocol.Close{Handle: s.info.Handle}, &protocol.OK{}); err != nil {
					errs = append(errs, fmt.Errorf("close volume: %w", err))
				}
			}
		} else if failed != nil {
			errs = append(errs, failed)
		}
		close(v.stop)
		<-v.superDone
		v.mu.Lock()
		set = v.set.Swap(nil)
		v.mu.Unlock()
		if set != nil {
			set.teardown()
		}
		v.fail(ErrClosed)
		v.resize.wg.Wait()
		v.mem.Free()
		v.m.sessions.Set(0)
		v.closeErr = errors.Join(errs...)
		v.log.Info("volume closed", zap.String("export", v.opts.Export), zap.NamedError("error", v.closeErr))
	})
	return v.closeErr
}

// List asks the target at addr for the exports hostID may open,
// authenticating with secret if it is not nil (see Options).
func List(ctx context.Context, p transport.Provider, addr, hostID string, secret []byte) ([]protocol.ExportEntry, error) {
	l, err := link.Dial(ctx, p, addr, link.Options{RecvBuffers: 8, SendBuffers: 8,
		Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		return nil, err
	}
	defer l.Close()
	if _, err := auth.Initiate(ctx, l, hostID, secret); err != nil {
		return nil, fmt.Errorf("list exports of %s: %w", addr, err)
	}
	var el protocol.ExportList
	if err := l.Request(ctx, &protocol.ListExports{}, &el); err != nil {
		return nil, fmt.Errorf("list exports of %s: %w", addr, err)
	}
	sort.Slice(el.Exports, func(i, j int) bool { return el.Exports[i].Name < el.Exports[j].Name })
	return el.Exports, nil
}

// Description names the volume and its target, for a front end to show.
func (v *Volume) Description() string {
	return fmt.Sprintf("rblk volume %q on %s", v.opts.Export, v.opts.Target)
}
