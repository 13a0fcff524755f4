package ublk

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/initiator/ublk/uring"
)

const controlPath = "/dev/ublk-control"

// Available tells whether the kernel can make ublk devices: it loads
// ublk_drv if /dev/ublk-control is missing, and returns ErrNoDriver (one
// line saying what is missing) when that does not help.
func Available() error {
	if _, err := os.Stat(controlPath); err == nil {
		return nil
	}
	_ = exec.Command("modprobe", "ublk_drv").Run()
	for range 50 { // devtmpfs makes the node soon after the module loads
		if _, err := os.Stat(controlPath); err == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return ErrNoDriver
}

// InUse tells whether /dev/ublkbN is held exclusively (mounted, or part of
// a device-mapper or RAID device).
func InUse(dev string) (bool, error) {
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, unix.EBUSY) {
			return true, nil
		}
		return false, &os.PathError{Op: "open", Path: dev, Err: err}
	}
	unix.Close(fd)
	return false, nil
}

// control is the ring on /dev/ublk-control: one command at a time.
type control struct {
	mu     sync.Mutex
	fd     int
	ring   *uring.Ring
	legacy bool // the kernel takes the bare command numbers only (< 6.4)
	// data is the commands' buffer, on the heap: the kernel reads and
	// writes it from a worker thread, while the caller's stack could move.
	data []byte
}

func openControl() (*control, error) {
	fd, err := unix.Open(controlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, ErrNoDriver
		}
		return nil, fmt.Errorf("ublk: open %s: %w", controlPath, err)
	}
	r, err := uring.New(4, uring.SetupSQE128)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ublk: control ring: %w", err)
	}
	return &control{fd: fd, ring: r, data: make([]byte, 128)}, nil
}

func (c *control) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ring != nil {
		c.ring.Close()
		unix.Close(c.fd)
		c.ring = nil
	}
}

// do runs one control command; buf, if any, is the command's data
// (cmd.addr and cmd.len).
func (c *control) do(nr uint32, devID uint32, buf []byte, data0 uint64) (int32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ring == nil {
		return 0, errors.New("ublk: control closed")
	}
	s := c.ring.GetSQE()
	s.Opcode = uring.OpURingCmd
	s.FD = int32(c.fd)
	s.Off = uint64(ctrlOp(nr, c.legacy))
	cmd := ctrlCmd{devID: devID, queueID: 0xffff, data0: data0}
	if len(buf) > 0 {
		n := copy(c.data, buf)
		cmd.addr = uint64(uintptr(unsafe.Pointer(&c.data[0])))
		cmd.len = uint16(n)
	}
	cmd.put(c.ring.Cmd(s))
	cqe, err := c.ring.Do()
	copy(buf, c.data)
	if err != nil {
		return 0, err
	}
	if cqe.Res < 0 {
		return cqe.Res, syscall.Errno(-cqe.Res)
	}
	return cqe.Res, nil
}

// Options describe the device to make.
type Options struct {
	Backend blockdev.Backend // required; its Submitter is used when it is one
	Size    uint64           // bytes, a multiple of 512
	// ReadOnly, CanTrim, CanZero, CanFUA describe the backend.
	ReadOnly, CanTrim, CanZero, CanFUA bool
	ID                                 int // the N of /dev/ublkbN; -1: the next free
	Queues                             int // 0: one per CPU
	Depth                              int // requests per queue; 0: DefaultDepth
	// NoUserCopy keeps to UBLK_F_NEED_GET_DATA (the kernel copies to and
	// from the buffer's address) where UBLK_F_USER_COPY (6.5+: this
	// process reads and writes the data on /dev/ublkcN) would be used.
	NoUserCopy bool
	Logger     *zap.Logger
}

// Defaults and limits.
const (
	DefaultDepth = 128
	MaxIO        = 256 << 10 // largest request: one buffer segment of initiator.Volume
)

// Device is a ublk device served by this process.
type Device struct {
	id     int
	opts   Options
	log    *zap.Logger
	ctrl   *control
	charFD int
	queues []*queue

	// ctx is the backend's: it ends when Detach gives up waiting.
	ctx    context.Context
	cancel context.CancelFunc

	done     chan struct{}
	doneOnce sync.Once
	errMu    sync.Mutex
	err      error
	pollStop chan struct{}
	pollDone chan struct{}

	detachOnce sync.Once
	detachErr  error
	stopping   atomic.Bool // Detach runs: the kernel ending the slots is expected
	userCopy   bool        // UBLK_F_USER_COPY: pread/pwrite the data, no addresses
}

// Attach makes the device, starts its queues and the device; it returns
// once /dev/ublkbN is there. ctx bounds the setup only.
func Attach(ctx context.Context, opts Options) (*Device, error) {
	if opts.Backend == nil {
		return nil, errors.New("ublk: no backend")
	}
	if opts.Size == 0 || opts.Size%512 != 0 {
		return nil, fmt.Errorf("ublk: size %d: want a positive multiple of 512", opts.Size)
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Queues <= 0 {
		opts.Queues = runtime.NumCPU()
	}
	opts.Queues = min(opts.Queues, 64)
	if opts.Depth <= 0 {
		opts.Depth = DefaultDepth
	}
	opts.Depth = min(opts.Depth, maxQueueDepth)
	if err := Available(); err != nil {
		return nil, err
	}
	ctrl, err := openControl()
	if err != nil {
		return nil, err
	}
	d := &Device{opts: opts, log: opts.Logger, ctrl: ctrl, charFD: -1, done: make(chan struct{}),
		pollStop: make(chan struct{}), pollDone: make(chan struct{})}
	d.ctx, d.cancel = context.WithCancel(context.Background())
	if err := d.add(); err != nil {
		d.cancel()
		ctrl.close()
		return nil, err
	}
	if err := d.start(ctx); err != nil {
		d.teardown()
		return nil, err
	}
	go d.poll()
	return d, nil
}

// add sends ADD_DEV and SET_PARAMS.
func (d *Device) add() error {
	// User copy where the kernel has it (6.5+: it then drops
	// NEED_GET_DATA), else "need data" for writes.
	info := devInfo{queues: uint16(d.opts.Queues), depth: uint16(d.opts.Depth), maxIOBytes: MaxIO,
		id: uint32(d.opts.ID), flags: fNeedGetData | fURingCmdCompInTsk | fCmdIoctlEncode}
	if !d.opts.NoUserCopy {
		info.flags |= fUserCopy
	}
	if d.opts.ID < 0 {
		info.id = ^uint32(0)
	}
	var b [devInfoSize]byte
	info.marshal(&b)
	_, err := d.ctrl.do(cmdAddDev, info.id, b[:], 0)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
		// A kernel before 6.4 knows the bare numbers only (and no user
		// copy).
		d.ctrl.legacy = true
		info.flags &^= fUserCopy
		info.marshal(&b)
		_, err = d.ctrl.do(cmdAddDev, info.id, b[:], 0)
		if err != nil {
			d.ctrl.legacy = false
		}
	}
	if err != nil {
		if errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("ublk: add device: %s exists already: %w", DevicePath(d.opts.ID), err)
		}
		return fmt.Errorf("ublk: add device: %w", err)
	}
	info.unmarshal(&b)
	d.id = int(info.id)
	d.userCopy = info.flags&fUserCopy != 0
	if !d.userCopy && info.flags&fNeedGetData == 0 {
		d.del()
		return errors.New("ublk: add device: the kernel does neither UBLK_F_USER_COPY nor UBLK_F_NEED_GET_DATA")
	}
	if int(info.queues) != d.opts.Queues || int(info.depth) != d.opts.Depth {
		d.log.Info("ublk: the kernel changed the queues", zap.Uint16("queues", info.queues), zap.Uint16("depth", info.depth))
		d.opts.Queues, d.opts.Depth = int(info.queues), int(info.depth)
	}
	p := params{logicalShift: 9, physicalShift: 12, optShift: 12, minShift: 9,
		maxSectors: MaxIO >> 9, devSectors: d.opts.Size >> 9, attrs: attrVolatileCache}
	if d.opts.ReadOnly {
		p.attrs |= attrReadOnly
	}
	if d.opts.CanFUA && !d.opts.ReadOnly {
		p.attrs |= attrFUA
	}
	if !d.opts.ReadOnly && (d.opts.CanTrim || d.opts.CanZero) {
		p.discard, p.discardGranularity = true, 4096
		if d.opts.CanTrim {
			p.maxDiscardSectors = 1 << 21 // 1 GiB
		}
		if d.opts.CanZero {
			p.maxWZSector = 1 << 21
		}
	}
	var pb [64]byte
	p.marshal(&pb)
	if _, err := d.ctrl.do(cmdSetParams, uint32(d.id), pb[:paramsLen], 0); err != nil {
		d.del()
		return fmt.Errorf("ublk: set parameters of device %d: %w", d.id, err)
	}
	return nil
}

func (d *Device) del() {
	if _, err := d.ctrl.do(cmdDelDev, uint32(d.id), nil, 0); err != nil {
		d.log.Warn("ublk: delete device", zap.Int("id", d.id), zap.Error(err))
	}
}

// start opens /dev/ublkcN, starts the queues and sends START_DEV.
func (d *Device) start(ctx context.Context) error {
	var fd int
	var err error
	for {
		// The char device node may lag the ADD_DEV a little.
		fd, err = unix.Open(charPath(d.id), unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err == nil || !errors.Is(err, unix.ENOENT) || ctx.Err() != nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("ublk: open %s: %w", charPath(d.id), err)
	}
	d.charFD = fd
	ready := make(chan error, d.opts.Queues)
	for i := range d.opts.Queues {
		q := newQueue(d, uint16(i))
		d.queues = append(d.queues, q)
		go q.run(ready)
	}
	for range d.queues {
		if err := <-ready; err != nil {
			return err
		}
	}
	// START_DEV waits until every tag of every queue is fetched, then
	// adds the disk, whose partition scan our queues serve.
	if _, err := d.ctrl.do(cmdStartDev, uint32(d.id), nil, uint64(os.Getpid())); err != nil {
		return fmt.Errorf("ublk: start device %d: %w", d.id, err)
	}
	return nil
}

// ID is the N of /dev/ublkbN.
func (d *Device) ID() int { return d.id }

// Path is the block device, /dev/ublkbN.
func (d *Device) Path() string { return DevicePath(d.id) }

// Queues is the number of hardware queues.
func (d *Device) Queues() int { return len(d.queues) }

// Done is closed when the device ends on its own: stopped by another
// process, or a queue failed (Err says why; nil for a stop).
func (d *Device) Done() <-chan struct{} { return d.done }

// Err is why Done was closed, nil for a stop by someone else.
func (d *Device) Err() error {
	d.errMu.Lock()
	defer d.errMu.Unlock()
	return d.err
}

func (d *Device) end(err error) {
	d.errMu.Lock()
	if d.err == nil {
		d.err = err
	}
	d.errMu.Unlock()
	d.doneOnce.Do(func() { close(d.done) })
}

// poll watches the device's state: a STOP_DEV by another process (such as
// rblk-attach detach) leaves our queues idle, not ended.
func (d *Device) poll() {
	defer close(d.pollDone)
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	var b [devInfoSize]byte
	for {
		select {
		case <-d.pollStop:
			return
		case <-t.C:
		}
		if _, err := d.ctrl.do(cmdGetDevInfo, uint32(d.id), b[:], 0); err != nil {
			continue
		}
		var info devInfo
		info.unmarshal(&b)
		if info.state != stateLive {
			d.end(nil)
			return
		}
	}
}

// Detach stops the device (the kernel fails what is queued and not yet
// fetched), waits for the requests the backend has (until ctx ends: then
// the backend's context is cancelled), and deletes the device.
func (d *Device) Detach(ctx context.Context) error {
	d.detachOnce.Do(func() {
		close(d.pollStop)
		<-d.pollDone
		d.stopping.Store(true)
		// STOP_DEV returns once the requests the kernel gave us are
		// committed: past ctx, the backend's are cancelled.
		stopped := make(chan error, 1)
		go func() {
			_, err := d.ctrl.do(cmdStopDev, uint32(d.id), nil, 0)
			stopped <- err
		}()
		var err error
		select {
		case err = <-stopped:
		case <-ctx.Done():
			d.log.Warn("ublk: stopping the device waits for the backend: cancelling its requests")
			d.cancel()
			err = <-stopped
		}
		if err != nil {
			d.detachErr = fmt.Errorf("ublk: stop device %d: %w", d.id, err)
		}
		d.stopQueues(ctx)
		d.teardown()
		d.end(nil)
	})
	return d.detachErr
}

// stopQueues makes the queue goroutines exit once the backend has no
// request of theirs.
func (d *Device) stopQueues(ctx context.Context) {
	for _, q := range d.queues {
		q.stop()
	}
	for _, q := range d.queues {
		select {
		case <-q.exited:
		case <-ctx.Done():
			d.log.Warn("ublk: requests still with the backend: cancelling them")
			d.cancel()
			<-q.exited
		}
	}
}

// teardown releases what start made and deletes the device; the queues
// have exited, or never started.
func (d *Device) teardown() {
	for _, q := range d.queues {
		q.stop()
		<-q.exited
	}
	if d.charFD >= 0 {
		unix.Close(d.charFD)
		d.charFD = -1
	}
	d.del()
	d.ctrl.close()
	d.cancel()
}

// Remove stops and deletes ublk device dev (/dev/ublkbN) whose server is
// gone (killed): the kernel keeps such a device until it is deleted.
func Remove(dev string) error {
	id, err := ParseDevice(dev)
	if err != nil {
		return err
	}
	if id < 0 {
		return errors.New("ublk: needs a device, not ublk")
	}
	c, err := openControl()
	if err != nil {
		return err
	}
	defer c.close()
	if _, err := c.do(cmdStopDev, uint32(id), nil, 0); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("ublk: stop %s: %w", dev, err)
	}
	if _, err := c.do(cmdDelDev, uint32(id), nil, 0); err != nil {
		return fmt.Errorf("ublk: delete %s: %w", dev, err)
	}
	return nil
}

// ServerPID reads the process serving /dev/ublkbN (or "ublk" is refused):
// the pid given at START_DEV, and whether the device is live.
func ServerPID(dev string) (pid int, live bool, err error) {
	id, err := ParseDevice(dev)
	if err != nil {
		return 0, false, err
	}
	if id < 0 {
		return 0, false, errors.New("ublk: needs a device, not ublk")
	}
	if err := Available(); err != nil {
		return 0, false, err
	}
	c, err := openControl()
	if err != nil {
		return 0, false, err
	}
	defer c.close()
	var b [devInfoSize]byte
	_, err = c.do(cmdGetDevInfo, uint32(id), b[:], 0)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
		c.legacy = true
		_, err = c.do(cmdGetDevInfo, uint32(id), b[:], 0)
	}
	if errors.Is(err, unix.ENODEV) {
		return 0, false, fmt.Errorf("%s: no such ublk device", dev)
	}
	if err != nil {
		return 0, false, fmt.Errorf("ublk: device info of %s: %w", dev, err)
	}
	var info devInfo
	info.unmarshal(&b)
	return int(info.pid), info.state == stateLive, nil
}

// Kinds of ring entries, in the high bits of user_data.
const (
	kindFetch   = 1 // FETCH_REQ and COMMIT_AND_FETCH_REQ
	kindGetData = 2 // NEED_GET_DATA
	kindWake    = 3 // the eventfd read
)

// Tag states on the completion list.
const (
	tagCommit  = iota // the request ended: commit t.res
	tagGotData        // a write's buffer is lent: ask the kernel for its data
)

// tag is one request slot of a queue.
type tag struct {
	q     *queue
	idx   uint16
	buf   *blockdev.Buffer
	op    uint8
	fua   bool
	nounm bool
	off   uint64
	n     int
	res   int32
	state int
	next  *tag
	dead  bool
}

type queue struct {
	d     *Device
	id    uint16
	ring  *uring.Ring
	iods  []byte
	tags  []tag
	efd   atomic.Int64 // -1 when closed
	efdMu sync.RWMutex // wakers read-lock it, release write-locks it
	one   [8]byte      // the eventfd write
	evbuf [8]byte      // the eventfd read
	dummy []byte       // the address committed with failed reads

	list        atomic.Pointer[tag] // the backend's completions
	awake       atomic.Bool         // the loop runs: no need to wake it
	wakePending atomic.Bool
	stopping    atomic.Bool
	exited      chan struct{}

	inflight int // tags with the backend (loop only)
	live     int // tags the kernel holds a command of (loop only)
	toFree   []*blockdev.Buffer

	be  blockdev.Backend   // the backend, or its queue id (blockdev.Queuer)
	sub blockdev.Submitter // be, if it is one
	pl  blockdev.Plugger   // sub, if it is one
	log *zap.Logger
}

func newQueue(d *Device, id uint16) *queue {
	q := &queue{d: d, id: id, exited: make(chan struct{}), log: d.log.With(zap.Uint16("queue", id))}
	// Each ublk queue on a queue of the backend (rblk: its own connection
	// to the target), as nvme-rdma's IO queues.
	q.be = d.opts.Backend
	if qr, ok := q.be.(blockdev.Queuer); ok {
		q.be = qr.Queue(int(id))
	}
	q.sub, _ = q.be.(blockdev.Submitter)
	q.pl, _ = q.sub.(blockdev.Plugger)
	q.efd.Store(-1)
	q.one[0] = 1
	q.tags = make([]tag, d.opts.Depth)
	for i := range q.tags {
		q.tags[i] = tag{q: q, idx: uint16(i)}
	}
	q.toFree = make([]*blockdev.Buffer, 0, d.opts.Depth)
	q.dummy = make([]byte, 4096)
	return q
}

// stop makes the loop exit once the backend has none of its requests.
func (q *queue) stop() {
	q.stopping.Store(true)
	q.wake()
}

func (q *queue) wake() {
	if q.wakePending.CompareAndSwap(false, true) {
		// (read-locked: release must not close the descriptor, and the
		// number be reused, between the load and the write)
		q.efdMu.RLock()
		if efd := q.efd.Load(); efd >= 0 {
			unix.Write(int(efd), q.one[:])
		}
		q.efdMu.RUnlock()
	}
}

// post puts t on the completion list and wakes the loop if it sleeps.
func (q *queue) post(t *tag) {
	for {
		h := q.list.Load()
		t.next = h
		if q.list.CompareAndSwap(h, t) {
			break
		}
	}
	if !q.awake.Load() {
		q.wake()
	}
}

// Complete ends a request of the backend (blockdev.Completion).
func (t *tag) Complete(err error) {
	t.res = resultOf(err, int32(t.n))
	t.state = tagCommit
	t.q.post(t)
}

func resultOf(err error, n int32) int32 {
	if err == nil {
		return n
	}
	var e syscall.Errno
	if errors.As(err, &e) && e != 0 {
		return -int32(e)
	}
	return -int32(unix.EIO)
}

func (q *queue) setup() error {
	d := q.d
	page := os.Getpagesize()
	size := roundUp(d.opts.Depth*iodSize, page)
	m, err := unix.Mmap(d.charFD, cmdBufOffsetOf(int(q.id), page), size, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("ublk: queue %d: mmap the descriptors: %w", q.id, err)
	}
	q.iods = m
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("ublk: queue %d: eventfd: %w", q.id, err)
	}
	q.efd.Store(int64(efd))
	// SQE128 for the kernels before 6.5, which want it on io commands too.
	q.ring, err = uring.New(uint32(2*d.opts.Depth), uring.SetupSQE128)
	if err != nil {
		return fmt.Errorf("ublk: queue %d: ring: %w", q.id, err)
	}
	return nil
}

func (q *queue) release() {
	if q.ring != nil {
		q.ring.Close() // cancels the commands the kernel holds
	}
	if q.iods != nil {
		unix.Munmap(q.iods)
	}
	q.efdMu.Lock()
	if efd := q.efd.Swap(-1); efd >= 0 {
		unix.Close(int(efd))
	}
	q.efdMu.Unlock()
}

// sqe returns a free entry, submitting what is queued when the ring is full.
func (q *queue) sqe() *uring.SQE {
	for {
		if s := q.ring.GetSQE(); s != nil {
			return s
		}
		if err := q.submit(0); err != nil {
			q.log.Error("ublk: submit", zap.Error(err))
		}
	}
}

// submit hands the queued entries to the kernel (waiting for wait
// completions); once all are taken, the buffers of the reads committed go
// back to the backend: the kernel copied them while taking the entries.
func (q *queue) submit(wait uint32) error {
	_, err := q.ring.Submit(wait)
	if q.ring.Pending() == 0 {
		for i, b := range q.toFree {
			q.be.Free(b)
			q.toFree[i] = nil
		}
		q.toFree = q.toFree[:0]
	}
	return err
}

func (q *queue) ioCmd(t *tag, nr uint32, kind uint64, result int32, addr uint64) {
	s := q.sqe()
	s.Opcode = uring.OpURingCmd
	s.FD = int32(q.d.charFD)
	s.Off = uint64(ioOp(nr, q.d.ctrl.legacy))
	s.UserData = kind<<32 | uint64(t.idx)
	putIOCmd(q.ring.Cmd(s), q.id, t.idx, result, addr)
}

func (q *queue) armWake() {
	s := q.sqe()
	s.Opcode = uring.OpRead
	s.FD = int32(q.efd.Load())
	s.Addr = uint64(uintptr(unsafe.Pointer(&q.evbuf[0])))
	s.Len = 8
	s.UserData = kindWake << 32
}

// run is the queue's goroutine: on one OS thread for its whole life (the
// thread ends with it), as the driver ties the queue to the fetching task.
func (q *queue) run(ready chan<- error) {
	runtime.LockOSThread()
	defer close(q.exited)
	defer q.release()
	if err := q.setup(); err != nil {
		ready <- err
		return
	}
	for i := range q.tags {
		q.ioCmd(&q.tags[i], ioFetchReq, kindFetch, 0, 0)
	}
	q.live = len(q.tags)
	q.armWake()
	if _, err := q.ring.Submit(0); err != nil {
		ready <- fmt.Errorf("ublk: queue %d: fetch: %w", q.id, err)
		return
	}
	ready <- nil
	q.loop()
}

func (q *queue) loop() {
	for {
		q.awake.Store(true)
		// The requests of one pass start together (blockdev.Plugger: one
		// doorbell for them all on RDMA) when there are several; nothing
		// in a pass blocks (tryAlloc, slow's goroutines).
		plugged := false
		c, ok := q.ring.PeekCQE()
		for ok {
			q.ring.Seen()
			next, more := q.ring.PeekCQE()
			if more && !plugged && q.pl != nil {
				q.pl.Plug()
				plugged = true
			}
			q.completion(c)
			c, ok = next, more
		}
		if plugged {
			q.pl.Unplug()
		}
		q.drain()
		if q.inflight == 0 && (q.stopping.Load() || q.live == 0) {
			if q.live == 0 && !q.stopping.Load() && !q.d.stopping.Load() {
				q.d.end(fmt.Errorf("ublk: queue %d: the kernel ended every request slot", q.id))
			}
			// (the last commits go to the kernel before the ring closes)
			if err := q.submit(0); err != nil {
				q.log.Warn("ublk: last commits", zap.Error(err))
			}
			for _, b := range q.toFree {
				q.be.Free(b)
			}
			q.toFree = nil
			return
		}
		q.awake.Store(false)
		if q.list.Load() != nil {
			continue
		}
		if err := q.submit(1); err != nil {
			q.log.Error("ublk: queue ring failed", zap.Error(err))
			q.d.end(fmt.Errorf("ublk: queue %d: %w", q.id, err))
			q.cancelAll()
			return
		}
	}
}

// cancelAll waits for the backend's requests after the ring failed.
func (q *queue) cancelAll() {
	for q.inflight > 0 {
		for q.list.Load() == nil {
			time.Sleep(time.Millisecond)
		}
		for t := q.list.Swap(nil); t != nil; {
			next := t.next
			q.inflight--
			if t.buf != nil {
				q.be.Free(t.buf)
				t.buf = nil
			}
			t = next
		}
	}
}

// drain commits the requests the backend ended and fetches the data of
// the writes whose buffer came.
func (q *queue) drain() {
	for t := q.list.Swap(nil); t != nil; {
		next := t.next
		t.next = nil
		switch t.state {
		case tagGotData:
			if q.d.userCopy {
				q.copyIn(t)
			} else {
				q.ioCmd(t, ioNeedGetData, kindGetData, 0, bufAddr(t.buf))
			}
		default:
			q.commit(t)
		}
		t = next
	}
}

func bufAddr(b *blockdev.Buffer) uint64 {
	return uint64(uintptr(unsafe.Pointer(&b.Segs[0][0])))
}

// commit reports t's result and fetches its next request. A read's buffer
// is freed once the entry is submitted: the kernel copies it then.
func (q *queue) commit(t *tag) {
	q.inflight--
	if q.d.userCopy {
		if b := t.buf; b != nil {
			if t.op == opRead && t.res > 0 {
				n, err := unix.Pwrite(q.d.charFD, b.Segs[0][:t.res], userCopyPos(q.id, t.idx))
				if err != nil || n != int(t.res) {
					q.log.Error("ublk: copying a read's data to the kernel", zap.Int("bytes", n), zap.Error(err))
					t.res = -int32(unix.EIO)
				}
			}
			q.be.Free(b)
			t.buf = nil
		}
		q.ioCmd(t, ioCommitAndFetch, kindFetch, t.res, 0)
		return
	}
	addr := uint64(uintptr(unsafe.Pointer(&q.dummy[0])))
	if t.buf != nil {
		addr = bufAddr(t.buf)
		q.toFree = append(q.toFree, t.buf)
		t.buf = nil
	}
	q.ioCmd(t, ioCommitAndFetch, kindFetch, t.res, addr)
}

// fail ends t at once with -errno.
func (q *queue) fail(t *tag, errno unix.Errno) {
	q.inflight++
	t.res = -int32(errno)
	q.commit(t)
}

func (q *queue) completion(c uring.CQE) {
	kind := c.UserData >> 32
	if kind == kindWake {
		q.wakePending.Store(false)
		if q.live > 0 || q.inflight > 0 {
			q.armWake()
		}
		return
	}
	t := &q.tags[uint16(c.UserData)]
	switch {
	case kind == kindFetch && c.Res == ioResOK:
		q.request(t)
	case kind == kindFetch && c.Res == ioResNeedGetData:
		q.read(t)
		q.inflight++
		q.lendForWrite(t)
	case kind == kindGetData && c.Res == ioResOK:
		q.write(t)
	default:
		if c.Res != -int32(unix.ENODEV) { // UBLK_IO_RES_ABORT: the device stops
			q.log.Error("ublk: the kernel refused a command", zap.Uint16("tag", t.idx), zap.Uint64("kind", kind), zap.Int32("res", c.Res))
		}
		if kind == kindGetData && t.buf != nil {
			q.be.Free(t.buf)
			t.buf = nil
			q.inflight--
		}
		t.dead = true
		q.live--
	}
}

// read loads t's descriptor.
func (q *queue) read(t *tag) {
	b := q.iods[int(t.idx)*iodSize:]
	le := binary.LittleEndian
	d := iod{opFlags: le.Uint32(b[0:]), sectors: le.Uint32(b[4:]), start: le.Uint64(b[8:])}
	t.op, t.fua, t.nounm = d.op(), d.opFlags&ioFFUA != 0, d.opFlags&ioFNoUnmap != 0
	t.off, t.n = d.start<<9, int(d.sectors)<<9
}

// request starts a request the kernel fetched.
func (q *queue) request(t *tag) {
	q.read(t)
	switch t.op {
	case opRead:
		if t.n <= 0 || t.n > MaxIO {
			q.fail(t, unix.EINVAL)
			return
		}
		q.inflight++
		b, ok := q.tryAlloc(t.n)
		if !ok || q.sub == nil {
			t.buf = b
			go q.slow(t)
			return
		}
		t.buf = b
		q.sub.SubmitRead(q.d.ctx, b, t.off, t)
	case opFlush, opDiscard, opWriteZeroes:
		if q.d.opts.ReadOnly && t.op != opFlush {
			q.fail(t, unix.EPERM)
			return
		}
		q.inflight++
		go q.slow(t)
	case opWrite:
		if !q.d.userCopy {
			q.fail(t, unix.EIO) // writes come as "need data" first
			return
		}
		if t.n <= 0 || t.n > MaxIO || q.d.opts.ReadOnly {
			q.fail(t, unix.EIO)
			return
		}
		q.inflight++
		b, ok := q.tryAlloc(t.n)
		if !ok {
			go q.slow(t) // lends the buffer, then the loop copies the data in
			return
		}
		t.buf = b
		q.copyIn(t)
	default:
		q.fail(t, unix.EOPNOTSUPP)
	}
}

// lendForWrite lends the buffer of a write the kernel asks data for.
func (q *queue) lendForWrite(t *tag) {
	if t.op != opWrite || t.n <= 0 || t.n > MaxIO || q.d.opts.ReadOnly {
		q.inflight--
		q.fail(t, unix.EIO)
		return
	}
	b, ok := q.tryAlloc(t.n)
	if !ok {
		go q.slow(t)
		return
	}
	t.buf = b
	q.ioCmd(t, ioNeedGetData, kindGetData, 0, bufAddr(b))
}

// copyIn reads a write's data from the kernel into t.buf (user copy),
// then submits it.
func (q *queue) copyIn(t *tag) {
	buf := t.buf.Segs[0][:t.n]
	n, err := unix.Pread(q.d.charFD, buf, userCopyPos(q.id, t.idx))
	if err != nil || n != t.n {
		q.log.Error("ublk: copying a write's data from the kernel", zap.Int("bytes", n), zap.Error(err))
		t.res = -int32(unix.EIO)
		q.commit(t)
		return
	}
	q.write(t)
}

// write submits a write whose data the kernel copied into t.buf.
func (q *queue) write(t *tag) {
	if q.sub == nil {
		go q.slow(t)
		return
	}
	q.sub.SubmitWrite(q.d.ctx, t.buf, t.off, t.fua, t)
}

// closedCtx makes Alloc fail at once rather than wait.
var closedCtx = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// tryAlloc lends a buffer without waiting: the loop must not block on the
// pool, whose buffers its own commits give back. A buffer of several
// segments is refused (returned, reported not ok: slow fails the request).
func (q *queue) tryAlloc(n int) (*blockdev.Buffer, bool) {
	b, err := q.be.Alloc(closedCtx, n)
	if err != nil || b == nil {
		return nil, false
	}
	if len(b.Segs) != 1 || len(b.Segs[0]) != n {
		q.be.Free(b)
		return nil, false
	}
	return b, true
}

// slow serves t on a goroutine of its own: a flush, discard or
// write-zeroes, a request without a Submitter, or one whose buffer must be
// waited for.
func (q *queue) slow(t *tag) {
	be, ctx := q.be, q.d.ctx
	alloc := func() bool {
		if t.buf != nil {
			return true
		}
		b, err := be.Alloc(ctx, t.n)
		if err == nil && (len(b.Segs) != 1 || len(b.Segs[0]) != t.n) {
			be.Free(b)
			q.log.Error("ublk: the backend lent a buffer of several segments", zap.Int("bytes", t.n))
			err = unix.EIO
		}
		if err != nil {
			t.Complete(err)
			return false
		}
		t.buf = b
		return true
	}
	switch t.op {
	case opRead:
		if alloc() {
			t.Complete(be.ReadAt(ctx, t.buf, t.off))
		}
	case opWrite:
		if t.buf == nil { // lend it, then the loop fetches the data
			if alloc() {
				t.state = tagGotData
				q.post(t)
			}
			return
		}
		t.Complete(be.WriteAt(ctx, t.buf, t.off, t.fua))
	case opFlush:
		t.n = 0
		t.Complete(be.Flush(ctx))
	case opDiscard:
		n := uint64(t.n)
		t.n = 0
		t.Complete(be.Trim(ctx, t.off, n, t.fua))
	case opWriteZeroes:
		n := uint64(t.n)
		t.n = 0
		t.Complete(be.WriteZeroes(ctx, t.off, n, t.nounm, t.fua))
	}
}
