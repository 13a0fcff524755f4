package kernel

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"

	"github.com/rblk/rblk/initiator/nbd"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// memBackend is an nbd.Backend in memory that logs the calls it completes;
// WriteAt waits on gate when it is set.
type memBackend struct {
	mu      sync.Mutex
	data    []byte
	events  []string
	gate    chan struct{} // WriteAt waits for it to close, if not nil
	entered chan struct{} // signalled when a WriteAt waits on gate
}

func newMemBackend(size int) *memBackend {
	return &memBackend{data: make([]byte, size), entered: make(chan struct{}, 16)}
}

func (b *memBackend) log(format string, args ...any) {
	b.mu.Lock()
	b.events = append(b.events, fmt.Sprintf(format, args...))
	b.mu.Unlock()
}

func (b *memBackend) Events() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.events)
}

func (b *memBackend) Alloc(_ context.Context, n int) (*nbd.Buffer, error) {
	return &nbd.Buffer{Segs: [][]byte{make([]byte, n)}}, nil
}
func (b *memBackend) Free(*nbd.Buffer) {}
func (b *memBackend) ReadAt(_ context.Context, buf *nbd.Buffer, off uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	copy(buf.Segs[0], b.data[off:])
	return nil
}
func (b *memBackend) WriteAt(ctx context.Context, buf *nbd.Buffer, off uint64, fua bool) error {
	b.mu.Lock()
	gate := b.gate
	b.mu.Unlock()
	if gate != nil {
		b.entered <- struct{}{}
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	b.mu.Lock()
	copy(b.data[off:], buf.Segs[0])
	b.mu.Unlock()
	b.log("write %d+%d", off, len(buf.Segs[0]))
	return nil
}
func (b *memBackend) Flush(context.Context) error {
	b.log("flush")
	return nil
}
func (b *memBackend) Trim(_ context.Context, off, n uint64, _ bool) error {
	b.log("trim %d+%d", off, n)
	return nil
}
func (b *memBackend) WriteZeroes(_ context.Context, off, n uint64, _, _ bool) error {
	b.log("zero %d+%d", off, n)
	return nil
}

// fakeKernel plays the kernel's NBD driver over pipes: connect takes the
// "descriptors" (keys of ends) and disconnect sends NBD_CMD_DISC on each
// socket and closes it, as nbd_disconnect_and_put does.
type fakeKernel struct {
	t  *testing.T
	mu sync.Mutex

	ends        map[int]net.Conn
	next        int
	closedFDs   []int
	cfg         connectConfig
	socks       []*fakeSock // of every connect
	cur         []*fakeSock // of the latest connect
	connectErr  error
	connects    int
	connectIdx  []int // the index each connect asked for
	disconnects int
	// readers[i] is how many sockets of connect i+1 the fake reads replies
	// from (the others are never read, as when the kernel's workqueue
	// rescuer holds their receive works); all beyond the slice.
	readers []int
	// noReceivers: receivers cannot tell.
	noReceivers bool
	// resizes are the reconfigures (resize_test.go); reconfigureErr fails
	// them.
	resizes        []resizeConfig
	reconfigureErr error
	// adopts are the reconfigures that hand over sockets (adopt_test.go).
	adopts         []adoptConfig
	adoptTakesNone bool
}

func newFakeKernel(t *testing.T) *fakeKernel {
	return &fakeKernel{t: t, ends: make(map[int]net.Conn), next: 100}
}

func (k *fakeKernel) pair() (net.Conn, int, error) {
	mine, theirs := net.Pipe()
	k.mu.Lock()
	defer k.mu.Unlock()
	k.next++
	k.ends[k.next] = theirs
	return sockConn{mine}, k.next, nil
}

// sockConn makes a pipe fail writes as a socket whose peer is gone does,
// with EPIPE.
type sockConn struct{ net.Conn }

func (c sockConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if errors.Is(err, io.ErrClosedPipe) {
		err = &net.OpError{Op: "write", Net: "pipe", Err: syscall.EPIPE}
	}
	return n, err
}

func (k *fakeKernel) closeFD(fd int) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.closedFDs = append(k.closedFDs, fd)
	if c, ok := k.ends[fd]; ok && !slices.ContainsFunc(k.socks, func(s *fakeSock) bool { return s.c == c }) {
		c.Close() // not handed over: the last reference goes
	}
	return nil
}

func (k *fakeKernel) connect(_ context.Context, cfg connectConfig) (int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.cfg = cfg
	if k.connectErr != nil {
		return -1, k.connectErr
	}
	k.connects++
	k.connectIdx = append(k.connectIdx, cfg.Index)
	readers := len(cfg.FDs)
	if k.connects <= len(k.readers) {
		readers = k.readers[k.connects-1]
	}
	k.cur = nil
	for i, fd := range cfg.FDs {
		s := newFakeSock(k.t, k.ends[fd], i < readers)
		k.socks = append(k.socks, s)
		k.cur = append(k.cur, s)
	}
	if cfg.Index >= 0 {
		return cfg.Index, nil
	}
	return 7, nil
}

func (k *fakeKernel) receivers(int) (int, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.noReceivers {
		return 0, false
	}
	n := 0
	for _, s := range k.cur {
		if s.reading && !s.isDead() {
			n++
		}
	}
	return n, true
}

func (k *fakeKernel) disconnect(context.Context, int) error {
	k.mu.Lock()
	k.disconnects++
	k.mu.Unlock()
	k.disconnectAll()
	return nil
}

func (k *fakeKernel) disconnectAll() {
	for _, s := range k.socks {
		s.send(nbdCmdDisc, 0, 0, 0, nil)
		s.c.Close()
	}
}

// NBD wire values for the fake (the server's own are unexported).
const (
	nbdRequestMagic = 0x25609513
	nbdReplyMagic   = 0x67446698
	nbdCmdRead      = 0
	nbdCmdWrite     = 1
	nbdCmdDisc      = 2
	nbdCmdFlush     = 3
	nbdCmdTrim      = 4
)

// fakeSock is the kernel's end of one socket: it sends requests and a
// goroutine collects the replies by cookie.
type fakeSock struct {
	t       *testing.T
	c       net.Conn
	reading bool // replies are read
	wmu     sync.Mutex
	mu      sync.Mutex
	cookie  uint64
	readLen map[uint64]uint32
	replies map[uint64]chan reply
	dead    bool // its reader saw the other end close
}

func (s *fakeSock) isDead() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dead
}

type reply struct {
	errno uint32
	data  []byte
}

func newFakeSock(t *testing.T, c net.Conn, reading bool) *fakeSock {
	s := &fakeSock{t: t, c: c, reading: reading, readLen: make(map[uint64]uint32), replies: make(map[uint64]chan reply)}
	if reading {
		go s.readReplies()
	}
	return s
}

func (s *fakeSock) readReplies() {
	defer func() {
		s.mu.Lock()
		s.dead = true
		s.mu.Unlock()
	}()
	var h [16]byte
	for {
		if _, err := io.ReadFull(s.c, h[:]); err != nil {
			return
		}
		if m := binary.BigEndian.Uint32(h[0:]); m != nbdReplyMagic {
			s.t.Errorf("reply magic %#x", m)
			return
		}
		errno, cookie := binary.BigEndian.Uint32(h[4:]), binary.BigEndian.Uint64(h[8:])
		s.mu.Lock()
		n, ch := s.readLen[cookie], s.replies[cookie]
		s.mu.Unlock()
		r := reply{errno: errno}
		if errno == 0 && n > 0 {
			r.data = make([]byte, n)
			if _, err := io.ReadFull(s.c, r.data); err != nil {
				return
			}
		}
		if ch == nil {
			s.t.Errorf("reply for unknown cookie %d", cookie)
			return
		}
		ch <- r
	}
}

// send writes one request and returns the channel its reply comes on.
func (s *fakeSock) send(typ uint16, flags uint16, off uint64, length uint32, payload []byte) chan reply {
	s.mu.Lock()
	s.cookie++
	cookie := s.cookie
	ch := make(chan reply, 1)
	s.replies[cookie] = ch
	if typ == nbdCmdRead {
		s.readLen[cookie] = length
	}
	s.mu.Unlock()
	var h [28]byte
	binary.BigEndian.PutUint32(h[0:], nbdRequestMagic)
	binary.BigEndian.PutUint16(h[4:], flags)
	binary.BigEndian.PutUint16(h[6:], typ)
	binary.BigEndian.PutUint64(h[8:], cookie)
	binary.BigEndian.PutUint64(h[16:], off)
	binary.BigEndian.PutUint32(h[24:], length)
	s.wmu.Lock()
	defer s.wmu.Unlock()
	s.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := s.c.Write(append(h[:], payload...)); err != nil && typ != nbdCmdDisc {
		s.t.Errorf("send request %d: %v", typ, err)
	}
	return ch
}

func (s *fakeSock) wait(ch chan reply) reply {
	s.t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(5 * time.Second):
		s.t.Fatal("no reply after 5s")
		return reply{}
	}
}

func testExport(be nbd.Backend) *nbd.Export {
	return &nbd.Export{Name: "vol", Size: 1 << 20, CanFlush: true, CanFUA: true, CanTrim: true, CanZero: true,
		MultiConn: true, Backend: be}
}

func TestAttachServeDetach(t *testing.T) {
	be := newMemBackend(1 << 20)
	k := newFakeKernel(t)
	dev, err := attach(context.Background(), Options{Export: testExport(be), Connections: 2, Device: "auto",
		Logger: zaptest.NewLogger(t)}, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	if dev.Path() != "/dev/nbd7" || dev.Index() != 7 || dev.Connections() != 2 {
		t.Errorf("device %s index %d, %d connections", dev.Path(), dev.Index(), dev.Connections())
	}
	want := connectConfig{Index: -1, SizeBytes: 1 << 20, BlockSizeBytes: 4096, Timeout: DefaultTimeout,
		ServerFlags: FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagSendTrim | FlagSendWriteZeroes | FlagCanMultiConn,
		Backend:     "rblk", FDs: []int{101, 102}}
	if fmt.Sprint(k.cfg) != fmt.Sprint(want) {
		t.Errorf("NBD_CMD_CONNECT\n got %+v\nwant %+v", k.cfg, want)
	}
	if !slices.Equal(k.closedFDs, []int{101, 102}) {
		t.Errorf("kernel ends closed: %v", k.closedFDs)
	}

	// IO on both sockets reaches the backend.
	s0, s1 := k.socks[0], k.socks[1]
	data := bytes.Repeat([]byte("rblk"), 1024)
	if r := s0.wait(s0.send(nbdCmdWrite, 0, 4096, 4096, data)); r.errno != 0 {
		t.Fatalf("WRITE: errno %d", r.errno)
	}
	if r := s1.wait(s1.send(nbdCmdRead, 0, 4096, 4096, nil)); r.errno != 0 || !bytes.Equal(r.data, data) {
		t.Fatalf("READ on the other socket: errno %d, data equal %v", r.errno, bytes.Equal(r.data, data))
	}
	if r := s1.wait(s1.send(nbdCmdFlush, 0, 0, 0, nil)); r.errno != 0 {
		t.Fatalf("FLUSH: errno %d", r.errno)
	}
	if r := s0.wait(s0.send(nbdCmdTrim, 0, 0, 8192, nil)); r.errno != 0 {
		t.Fatalf("TRIM: errno %d", r.errno)
	}

	// A write in flight when the kernel disconnects: Detach waits for it,
	// then flushes.
	gate := make(chan struct{})
	be.mu.Lock()
	be.gate = gate
	be.mu.Unlock()
	s0.send(nbdCmdWrite, 0, 65536, 4096, data)
	<-be.entered
	detached := make(chan error, 1)
	go func() { detached <- dev.Detach(context.Background()) }()
	select {
	case err := <-detached:
		t.Fatalf("Detach returned %v with a write in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(gate)
	if err := <-detached; err != nil {
		t.Fatalf("Detach: %v", err)
	}
	ev := be.Events()
	wantTail := []string{"write 65536+4096", "flush"}
	if len(ev) < 2 || !slices.Equal(ev[len(ev)-2:], wantTail) {
		t.Errorf("backend calls %q: want them to end with %q", ev, wantTail)
	}
	if k.disconnects != 1 {
		t.Errorf("%d NBD_CMD_DISCONNECT, want 1", k.disconnects)
	}
	select {
	case <-dev.Done():
	default:
		t.Error("Done not closed after Detach")
	}
	if err := dev.Err(); err != nil {
		t.Errorf("Err: %v", err)
	}
	if err := dev.Detach(context.Background()); err != nil || k.disconnects != 1 {
		t.Errorf("second Detach: %v, %d disconnects", err, k.disconnects)
	}
}

// A disconnect by another process (rblk-attach detach): Done closes, and
// Detach flushes without sending NBD_CMD_DISCONNECT again.
func TestDisconnectedByOther(t *testing.T) {
	be := newMemBackend(1 << 20)
	k := newFakeKernel(t)
	dev, err := attach(context.Background(), Options{Export: testExport(be), Connections: 3,
		Logger: zaptest.NewLogger(t)}, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	s := k.socks[2]
	if r := s.wait(s.send(nbdCmdWrite, 0, 0, 512, make([]byte, 512))); r.errno != 0 {
		t.Fatalf("WRITE: errno %d", r.errno)
	}
	k.disconnectAll()
	select {
	case <-dev.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed after the kernel disconnected")
	}
	if err := dev.Err(); err != nil {
		t.Errorf("Err after NBD_CMD_DISC: %v", err)
	}
	if err := dev.Detach(context.Background()); err != nil {
		t.Fatal(err)
	}
	if k.disconnects != 0 {
		t.Errorf("Detach sent NBD_CMD_DISCONNECT to a device the kernel had let go")
	}
	if ev := be.Events(); !slices.Equal(ev, []string{"write 0+512", "flush"}) {
		t.Errorf("backend calls %q", ev)
	}
}

// shortReceiversWait makes Attach wait d for the kernel to read every
// socket.
func shortReceiversWait(t *testing.T, d time.Duration) {
	old := receiversWait
	receiversWait = d
	t.Cleanup(func() { receiversWait = old })
}

// The kernel may leave a socket unread: when it is slow to start workqueue
// workers at NBD_CMD_CONNECT, its workqueue rescuer runs the receive work of
// one socket and the others wait behind it until that socket ends (the
// 3-minute stall of the first attach after boot in vm/rblk-e2e.sh). Attach
// notices, and attaches the device again as the same /dev/nbdN.
func TestAttachAgainWhenASocketIsNotRead(t *testing.T) {
	shortReceiversWait(t, 200*time.Millisecond)
	// Attaching again must not open the device: that first open reads the
	// partition table, which may go to the unread socket.
	var opened []string
	inUseCheck = func(path string) (bool, error) {
		opened = append(opened, path)
		return false, nil
	}
	t.Cleanup(func() { inUseCheck = inUse })
	be := newMemBackend(1 << 20)
	k := newFakeKernel(t)
	k.readers = []int{1} // first connect: only socket 0 is read
	dev, err := attach(context.Background(), Options{Export: testExport(be), Connections: 2, Device: "auto",
		Logger: zaptest.NewLogger(t)}, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	if k.connects != 2 || k.disconnects != 1 || !slices.Equal(k.connectIdx, []int{-1, 7}) {
		t.Errorf("%d NBD_CMD_CONNECT (for devices %v), %d NBD_CMD_DISCONNECT; want 2 (for -1, then 7) and 1",
			k.connects, k.connectIdx, k.disconnects)
	}
	if dev.Path() != "/dev/nbd7" || dev.Connections() != 2 {
		t.Errorf("device %s, %d connections", dev.Path(), dev.Connections())
	}
	if len(opened) != 0 {
		t.Errorf("Attach opened %q", opened)
	}
	if !slices.Equal(k.closedFDs, []int{101, 102, 103, 104}) {
		t.Errorf("kernel ends closed: %v", k.closedFDs)
	}
	// Both sockets of the new connection are served.
	s0, s1 := k.cur[0], k.cur[1]
	data := bytes.Repeat([]byte("rblk"), 1024)
	if r := s0.wait(s0.send(nbdCmdWrite, 0, 0, 4096, data)); r.errno != 0 {
		t.Fatalf("WRITE: errno %d", r.errno)
	}
	if r := s1.wait(s1.send(nbdCmdRead, 0, 0, 4096, nil)); r.errno != 0 || !bytes.Equal(r.data, data) {
		t.Fatalf("READ on the other socket: errno %d, data equal %v", r.errno, bytes.Equal(r.data, data))
	}
	if err := dev.Detach(context.Background()); err != nil {
		t.Fatal(err)
	}
	if ev := be.Events(); !slices.Equal(ev, []string{"flush", "write 0+4096", "flush"}) {
		t.Errorf("backend calls %q", ev)
	}
}

// A socket still unread after attachAttempts: Attach gives up attaching
// again and returns the device, whose other sockets work (the kernel moves
// the requests of the unread one to them after the request timeout).
func TestAttachGivesUpAttachingAgain(t *testing.T) {
	shortReceiversWait(t, 50*time.Millisecond)
	k := newFakeKernel(t)
	k.readers = []int{1, 1, 1, 1}
	dev, err := attach(context.Background(), Options{Export: testExport(newMemBackend(1 << 20)), Connections: 2,
		Device: "nbd4", Logger: zaptest.NewLogger(t)}, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	if k.connects != attachAttempts || k.disconnects != attachAttempts-1 {
		t.Errorf("%d NBD_CMD_CONNECT, %d NBD_CMD_DISCONNECT; want %d and %d", k.connects, k.disconnects,
			attachAttempts, attachAttempts-1)
	}
	if s := k.cur[0]; s.wait(s.send(nbdCmdRead, 0, 0, 512, nil)).errno != 0 {
		t.Error("READ failed")
	}
	if err := dev.Detach(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A kernel that does not tell which sockets it reads: Attach does not wait.
func TestAttachReceiversUnknown(t *testing.T) {
	shortReceiversWait(t, time.Minute)
	k := newFakeKernel(t)
	k.noReceivers = true
	done := make(chan struct{})
	go func() {
		defer close(done)
		dev, err := attach(context.Background(), Options{Export: testExport(newMemBackend(1 << 20)), Connections: 2},
			k, k.pair, k.closeFD)
		if err != nil {
			t.Error(err)
			return
		}
		if err := dev.Detach(context.Background()); err != nil {
			t.Error(err)
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Attach waits for receivers the kernel does not show")
	}
	if k.connects != 1 {
		t.Errorf("%d NBD_CMD_CONNECT, want 1", k.connects)
	}
}

func TestAttachReadOnly(t *testing.T) {
	be := newMemBackend(1 << 20)
	k := newFakeKernel(t)
	e := testExport(be)
	e.ReadOnly, e.CanFUA = true, false
	dev, err := attach(context.Background(), Options{Export: e, Connections: 1, Device: "/dev/nbd2",
		Timeout: -1, DeadConnTimeout: 3 * time.Second, Backend: "x", Logger: zaptest.NewLogger(t)}, k, k.pair, k.closeFD)
	if err != nil {
		t.Fatal(err)
	}
	want := connectConfig{Index: 2, SizeBytes: 1 << 20, BlockSizeBytes: 4096, DeadConnTimeout: 3 * time.Second,
		ServerFlags: FlagHasFlags | FlagReadOnly | FlagSendFlush | FlagCanMultiConn, Backend: "x", FDs: []int{101}}
	if fmt.Sprint(k.cfg) != fmt.Sprint(want) {
		t.Errorf("NBD_CMD_CONNECT\n got %+v\nwant %+v", k.cfg, want)
	}
	s := k.socks[0]
	if r := s.wait(s.send(nbdCmdWrite, 0, 0, 512, make([]byte, 512))); r.errno != 1 { // EPERM
		t.Errorf("WRITE on a read-only device: errno %d, want EPERM", r.errno)
	}
	if err := dev.Detach(context.Background()); err != nil {
		t.Fatal(err)
	}
	if ev := be.Events(); len(ev) != 0 {
		t.Errorf("backend calls on a read-only device: %q", ev)
	}
}

func TestAttachConnectFails(t *testing.T) {
	k := newFakeKernel(t)
	k.connectErr = fmt.Errorf("NBD_CMD_CONNECT: %w: device or resource busy", ErrInUse)
	_, err := attach(context.Background(), Options{Export: testExport(newMemBackend(1 << 20)), Connections: 2,
		Device: "nbd3"}, k, k.pair, k.closeFD)
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "/dev/nbd3 is attached already") {
		t.Errorf("error %v", err)
	}
	if len(k.closedFDs) != 2 {
		t.Errorf("kernel ends closed: %v", k.closedFDs)
	}
	// goleak (TestMain) checks that the serving goroutines ended.
}

func TestAttachBadOptions(t *testing.T) {
	k := newFakeKernel(t)
	be := newMemBackend(1 << 20)
	single := testExport(be)
	single.MultiConn = false
	odd := testExport(be)
	odd.Size = 1000
	small := testExport(be)
	small.MaxBlock = 1 << 20
	for name, opts := range map[string]Options{
		"not multi-conn": {Export: single, Connections: 2},
		"odd size":       {Export: odd},
		"small MaxBlock": {Export: small},
		"bad device":     {Export: testExport(be), Device: "/dev/sda"},
		"bad block size": {Export: testExport(be), BlockSize: 8192},
		"no backend":     {Export: &nbd.Export{Name: "x", Size: 4096}},
	} {
		if _, err := attach(context.Background(), opts, k, k.pair, k.closeFD); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if len(k.ends) != 0 {
		t.Errorf("sockets made for refused options")
	}
}
