package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/internal/lockfile"
)

// DefaultSocket is where rblkd listens for admin requests.
const DefaultSocket = "/run/rblk/rblkd.sock"

// The commands of a Request.
const (
	CmdList   = "list"   // the exports, with their sessions
	CmdAdd    = "add"    // Request.Export
	CmdRemove = "remove" // Request.Name, drained first
	CmdGrow   = "grow"   // Request.Name to Request.Size bytes
	CmdReload = "reload" // the configuration file, as SIGHUP

	// The volumes of storage pools (package manage).
	CmdPools     = "pools"     // the pools and their capacity (Request.Pool: only it)
	CmdVolumes   = "volumes"   // the pools' volumes (Request.Pool: only its)
	CmdCreate    = "create"    // Request.Pool, Name, Size, Shared
	CmdDelete    = "delete"    // Request.Pool, Name: drained, written back, deleted
	CmdExpand    = "expand"    // Request.Pool, Name to Request.Size bytes
	CmdPublish   = "publish"   // Request.Pool, Name: Request.Host may open it
	CmdUnpublish = "unpublish" // Request.Pool, Name: Request.Host fenced off it
)

// maxRequest bounds a request's size.
const maxRequest = 1 << 20

// Request is what a client sends: one JSON object per connection.
type Request struct {
	Command string  `json:"command"`
	Export  *Export `json:"export,omitempty"` // add
	Name    string  `json:"name,omitempty"`   // remove, grow
	Size    int64   `json:"size,omitempty"`   // grow, create, expand: the size in bytes
	Pool    string  `json:"pool,omitempty"`   // pools, volumes, create, delete, expand, publish, unpublish
	Host    string  `json:"host,omitempty"`   // publish, unpublish: the host ID
	Shared  bool    `json:"shared,omitempty"` // create: several hosts may write at once
	// Save writes the change to the configuration file rblkd was started
	// with (add, remove, grow).
	Save bool `json:"save,omitempty"`
}

// Export is an export in a Request (add) and in a Response (list). The
// JSON shape is stable: fields are only ever added.
type Export struct {
	Name string `json:"name"`
	Path string `json:"path"`
	// Size: in add, the size of the sparse file to create if Path does
	// not exist (0: it must exist); in list, the volume's size now.
	Size int64 `json:"size"`
	// ConfiguredSize (list): the size the export was configured with (0:
	// none).
	ConfiguredSize int64    `json:"configured_size,omitempty"`
	ReadOnly       bool     `json:"read_only"`
	Shared         bool     `json:"shared"`
	Allow          []string `json:"allow"` // empty: every host, unless Private
	// Private: only the hosts in Allow may open it; with Allow empty,
	// none (a pool's volume published to no host).
	Private bool `json:"private,omitempty"`
	// Sessions and Writers (list): the sessions that have it open, and
	// of those the read-write ones.
	Sessions    int  `json:"sessions"`
	Writers     int  `json:"writers"`
	BlockDevice bool `json:"block_device"`
}

// Volume is a pool's volume in a Response. The JSON shape is stable:
// fields are only ever added.
type Volume struct {
	Pool      string            `json:"pool"`
	Name      string            `json:"name"`
	Export    string            `json:"export"` // the name initiators open it by
	Path      string            `json:"path"`
	Size      int64             `json:"size"`
	Allocated int64             `json:"allocated"`
	Shared    bool              `json:"shared"`
	Hosts     []string          `json:"hosts"` // published to
	Sessions  int               `json:"sessions"`
	Writers   int               `json:"writers"`
	Labels    map[string]string `json:"labels,omitempty"`
	Created   time.Time         `json:"created"`
}

// Pool is a storage pool in a Response.
type Pool struct {
	Name        string            `json:"name"`
	Labels      map[string]string `json:"labels,omitempty"`
	Capacity    int64             `json:"capacity"`    // its limit
	Provisioned int64             `json:"provisioned"` // the sum of its volumes' sizes
	Allocated   int64             `json:"allocated"`   // what they take on disk
	Available   int64             `json:"available"`   // the largest volume it takes now
	Volumes     int               `json:"volumes"`
	Damaged     int               `json:"damaged"` // volumes not served (see rblkd's log)
}

// Response is rblkd's answer: OK, or Error saying why not.
type Response struct {
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
	// Code is the kind of error (manage.Code: InvalidArgument, NotFound,
	// AlreadyExists, ResourceExhausted, ...), where rblkd knows it.
	Code    string   `json:"code,omitempty"`
	Message string   `json:"message,omitempty"` // what was done, for people
	Exports []Export `json:"exports,omitempty"` // list
	Volumes []Volume `json:"volumes,omitempty"` // volumes, create, expand, publish
	Pools   []Pool   `json:"pools,omitempty"`   // pools
	// Created (create): the volume was made by this request (false: it
	// existed as asked).
	Created bool `json:"created,omitempty"`
	// Fenced (unpublish): the sessions fenced.
	Fenced int `json:"fenced,omitempty"`
}

// Handler serves one request; ctx ends at the server's request timeout or
// when the server closes.
type Handler func(ctx context.Context, req Request) Response

// ServerOptions configure a Server.
type ServerOptions struct {
	// Timeout bounds one request, its handling included. Default 10m (a
	// remove drains its sessions).
	Timeout time.Duration
	// Logger: refused peers and malformed requests. Default: no logs.
	Logger *zap.Logger
	// AllowUID is the one user besides root whose processes may send
	// requests. Default: the daemon's own effective user.
	AllowUID *uint32
}

// Server accepts admin requests on a unix socket.
type Server struct {
	path string
	ln   *net.UnixListener
	lock *os.File // PATH.lock, locked (flock) while the server lives
	h    Handler
	opts ServerOptions
	log  *zap.Logger

	ctx       context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
}

// ErrInUse: another live process listens on the socket, or holds its lock
// file on the way to it.
var ErrInUse = errors.New("admin socket in use by another process")

// LockSuffix names the lock file of an admin socket: PATH.lock beside the
// socket PATH.
const LockSuffix = ".lock"

// listenHook, if set (by this package's tests), is called at the stages
// of Listen: "locked" once it holds the lock file, before it binds;
// "stale" once it found a socket nobody answers on, before it removes it.
var listenHook func(path, stage string)

func hook(path, stage string) {
	if listenHook != nil {
		listenHook(path, stage)
	}
}

// Listen creates the socket at path (its directory 0755 if missing, the
// socket 0600) and serves h on it until Close.
//
// The path belongs to the process that holds its lock file, PATH.lock
// (flock, taken without waiting and held until Close; the file itself
// stays): of two processes that call Listen on one path at once, one gets
// the lock and the socket, the other ErrInUse at once, whatever the
// timing. The holder then binds the socket. A socket already there was
// left by a process that died (it refuses connections: removed, and bound
// anew) or belongs to a live process that does not take the lock (it
// accepts a connection: ErrInUse). Anything else at path is refused.
func Listen(path string, h Handler, opts ServerOptions) (*Server, error) {
	if opts.Timeout == 0 {
		opts.Timeout = 10 * time.Minute
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.AllowUID == nil {
		uid := uint32(os.Geteuid())
		opts.AllowUID = &uid
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	lock, err := lockFile(path + LockSuffix)
	if err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	hook(path, "locked")
	ln, err := bind(path)
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	// (Until the chmod the umask's mode applies: the peer check refuses
	// others all the same.)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		lock.Close()
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	s := &Server{path: path, ln: ln, lock: lock, h: h, opts: opts, log: opts.Logger}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// lockFile takes the lock file name (package lockfile): ErrInUse if
// another open file holds it.
func lockFile(name string) (*os.File, error) {
	f, err := lockfile.Lock(name)
	if errors.Is(err, lockfile.ErrLocked) {
		return nil, fmt.Errorf("%w: another process holds its lock file %s", ErrInUse, name)
	}
	return f, err
}

// bind listens on the unix socket path, whose lock file the caller holds.
// Something already at path is judged by a connection to it: a socket
// that refuses it was left by a process that died and is replaced; one
// that accepts it (or whose backlog is full) is a live process's.
func bind(path string) (*net.UnixListener, error) {
	addr := &net.UnixAddr{Name: path, Net: "unix"}
	for attempt := 0; ; attempt++ {
		ln, err := net.ListenUnix("unix", addr)
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) || attempt == 2 {
			return ln, err
		}
		st, lerr := os.Lstat(path)
		if errors.Is(lerr, fs.ErrNotExist) {
			continue // gone meanwhile
		}
		if lerr != nil {
			return nil, lerr
		}
		if st.Mode()&os.ModeSocket == 0 {
			return nil, errors.New("exists and is not a socket")
		}
		c, derr := net.DialTimeout("unix", path, time.Second)
		switch {
		case derr == nil:
			c.Close()
			return nil, fmt.Errorf("%w (it answers, and does not take the lock file %s)", ErrInUse, path+LockSuffix)
		case errors.Is(derr, syscall.EAGAIN):
			return nil, fmt.Errorf("%w (its backlog is full)", ErrInUse)
		case errors.Is(derr, syscall.ENOENT):
			continue
		case !errors.Is(derr, syscall.ECONNREFUSED):
			return nil, fmt.Errorf("check the socket there: %w", derr)
		}
		hook(path, "stale")
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove the stale socket: %w", err)
		}
	}
}

// Path is the socket's path.
func (s *Server) Path() string { return s.path }

// Close stops accepting, ends the requests in progress (their context is
// cancelled) and waits for them, removes the socket and then releases
// its lock file. It is safe to call twice.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		s.cancel()
		s.ln.Close()
		s.wg.Wait()
		s.lock.Close()
	})
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if s.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				s.log.Warn("admin socket: accept", zap.Error(err))
				continue
			}
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer c.Close()
			s.serve(c)
		}()
	}
}

// PeerUID is the user of the process at the other end of c.
func PeerUID(c *net.UnixConn) (uint32, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if credErr != nil {
		return 0, fmt.Errorf("SO_PEERCRED: %w", credErr)
	}
	return cred.Uid, nil
}

// Allowed reports whether a peer of user uid may send requests: root, or
// allow (the daemon's own user).
func Allowed(uid, allow uint32) bool { return uid == 0 || uid == allow }

func (s *Server) serve(c *net.UnixConn) {
	c.SetDeadline(time.Now().Add(s.opts.Timeout))
	uid, err := PeerUID(c)
	if err != nil {
		s.log.Warn("admin socket: peer credentials", zap.Error(err))
		return
	}
	if !Allowed(uid, *s.opts.AllowUID) {
		s.log.Warn("admin socket: request refused: only root may manage rblkd", zap.Uint32("uid", uid))
		writeResponse(c, Response{Error: fmt.Sprintf("permission denied: uid %d may not manage rblkd (root only)", uid)})
		return
	}
	var req Request
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	dec := json.NewDecoder(io.LimitReader(c, maxRequest))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		if errors.Is(err, io.EOF) {
			return // connected and left (as a check for a live server does)
		}
		s.log.Warn("admin socket: malformed request", zap.Uint32("uid", uid), zap.Error(err))
		writeResponse(c, Response{Error: "malformed request: " + err.Error()})
		return
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.opts.Timeout)
	defer cancel()
	resp := s.h(ctx, req)
	if !resp.OK && resp.Error == "" {
		resp.Error = "failed"
	}
	if err := writeResponse(c, resp); err != nil {
		s.log.Warn("admin socket: reply", zap.String("command", req.Command), zap.Error(err))
	}
}

func writeResponse(c net.Conn, r Response) error {
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	return json.NewEncoder(c).Encode(r)
}

// ErrFailed is wrapped by Do's error when rblkd answered with an error.
var ErrFailed = errors.New("rblkd refused the request")

// Do sends req to the rblkd listening on path and returns its response.
// An error reply is returned as an error wrapping ErrFailed, with the
// response.
func Do(ctx context.Context, path string, req Request) (Response, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return Response{}, fmt.Errorf("connect to rblkd at %s: %w (is rblkd running, with this --admin-socket?)", path, err)
		}
		if errors.Is(err, syscall.EACCES) {
			return Response{}, fmt.Errorf("connect to rblkd at %s: %w (run as root)", path, err)
		}
		return Response{}, fmt.Errorf("connect to rblkd at %s: %w", path, err)
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	if err := json.NewEncoder(c).Encode(req); err != nil {
		return Response{}, fmt.Errorf("send %s request to %s: %w", req.Command, path, err)
	}
	var resp Response
	if err := json.NewDecoder(io.LimitReader(c, 64<<20)).Decode(&resp); err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return Response{}, fmt.Errorf("read the answer to %s from %s: %w", req.Command, path, err)
	}
	if !resp.OK {
		return resp, fmt.Errorf("%s: %s: %w", req.Command, resp.Error, ErrFailed)
	}
	return resp, nil
}
