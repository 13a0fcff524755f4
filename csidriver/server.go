package csidriver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// Server serves the CSI services on a unix socket.
type Server struct {
	srv  *grpc.Server
	ln   net.Listener
	done chan struct{}
}

// Listen serves the services that are not nil on endpoint
// (unix:///path or unix:/path). A socket left at the path by a process
// that is gone is replaced.
func Listen(endpoint string, id csi.IdentityServer, ctrl csi.ControllerServer, node csi.NodeServer, log *zap.Logger) (*Server, error) {
	path, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok {
		if path, ok = strings.CutPrefix(endpoint, "unix:"); !ok {
			return nil, fmt.Errorf("--endpoint %q: want unix:///PATH", endpoint)
		}
	}
	if log == nil {
		log = zap.NewNop()
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("--endpoint: %w", err)
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode()&fs.ModeSocket == 0 {
			return nil, fmt.Errorf("--endpoint: %s exists and is not a socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("--endpoint: %s: another process serves on it", path)
		}
		os.Remove(path)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("--endpoint: %w", err)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("--endpoint: %w", err)
	}
	logCalls := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := h(ctx, req)
		if err != nil {
			st := status.Convert(err)
			log.Warn("CSI call failed", zap.String("method", info.FullMethod), zap.String("code", st.Code().String()),
				zap.String("error", st.Message()), zap.Duration("took", time.Since(start)))
		} else if !strings.HasSuffix(info.FullMethod, "/Probe") && !strings.HasSuffix(info.FullMethod, "Capabilities") {
			log.Info("CSI call", zap.String("method", info.FullMethod), zap.Duration("took", time.Since(start)))
		}
		return resp, err
	}
	s := &Server{srv: grpc.NewServer(grpc.ChainUnaryInterceptor(logCalls)), ln: ln, done: make(chan struct{})}
	if id != nil {
		csi.RegisterIdentityServer(s.srv, id)
	}
	if ctrl != nil {
		csi.RegisterControllerServer(s.srv, ctrl)
	}
	if node != nil {
		csi.RegisterNodeServer(s.srv, node)
	}
	go func() {
		defer close(s.done)
		s.srv.Serve(ln)
	}()
	return s, nil
}

// Close stops serving: requests in progress get 10 seconds.
func (s *Server) Close() {
	stopped := make(chan struct{})
	go func() { s.srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		s.srv.Stop()
	}
	<-s.done
}
