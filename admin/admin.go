package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
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
)

// maxRequest bounds a request's size.
const maxRequest = 1 << 20

// Request is what a client sends: one JSON object per connection.
type Request struct {
	Command string  `json:"command"`
	Export  *Export `json:"export,omitempty"` // add
	Name    string  `json:"name,omitempty"`   // remove, grow
	Size    int64   `json:"size,omitempty"`   // grow: the new size in bytes
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
	Allow          []string `json:"allow"` // empty: every host
	// Sessions and Writers (list): the sessions that have it open, and
	// of those the read-write ones.
	Sessions    int  `json:"sessions"`
	Writers     int  `json:"writers"`
	BlockDevice bool `json:"block_device"`
}

// Response is rblkd's answer: OK, or Error saying why not.
type Response struct {
	OK      bool     `json:"ok"`
	Error   string   `json:"error,omitempty"`
	Message string   `json:"message,omitempty"` // what was done, for people
	Exports []Export `json:"exports,omitempty"` // list
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
	h    Handler
	opts ServerOptions
	log  *zap.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// ErrInUse: another live process listens on the socket.
var ErrInUse = errors.New("admin socket in use by another process")

// Listen creates the socket at path (its directory 0755 if missing, the
// socket 0600; a stale socket left by a process that died is replaced) and
// serves h on it until Close.
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
	if st, err := os.Lstat(path); err == nil {
		if st.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("admin socket %s: exists and is not a socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("admin socket %s: %w", path, ErrInUse)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("admin socket %s: remove the stale socket: %w", path, err)
		}
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(true)
	// (Until the chmod the umask's mode applies: the peer check refuses
	// others all the same.)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	s := &Server{path: path, ln: ln, h: h, opts: opts, log: opts.Logger}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Path is the socket's path.
func (s *Server) Path() string { return s.path }

// Close stops accepting, ends the requests in progress (their context is
// cancelled) and waits for them, and removes the socket.
func (s *Server) Close() {
	s.cancel()
	s.ln.Close()
	s.wg.Wait()
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
