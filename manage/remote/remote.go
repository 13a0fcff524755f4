package remote

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"golang.org/x/net/netutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/rblk/rblk/manage"
	"github.com/rblk/rblk/manage/managepb"
)

// AllPools in a Client's Pools lets it manage every pool.
const AllPools = "*"

// Client is a client the server lets in: the Common Name of its
// certificate and the pools it may manage.
type Client struct {
	Identity string
	Pools    []string
}

// Defaults of Options.
const (
	DefaultMaxConns   = 64
	DefaultMaxStreams = 16
)

// Options configure a Server.
type Options struct {
	// Listen is the address to serve on, HOST:PORT.
	Listen string
	// CertFile and KeyFile are the server's certificate (chain) and key,
	// PEM; ClientCAFile the CA certificates that sign clients'.
	CertFile, KeyFile, ClientCAFile string
	// Clients are the clients let in, by identity.
	Clients []Client
	// MaxConns bounds the connections at once (default DefaultMaxConns);
	// MaxStreams the requests at once on one (default DefaultMaxStreams).
	MaxConns, MaxStreams int
	// Logger: requests refused and failed. Default: none.
	Logger *zap.Logger
	// Registerer, if set, gets rblkd_manage_requests_total{method,code}.
	Registerer prometheus.Registerer
}

// Server serves the management API.
type Server struct {
	srv      *grpc.Server
	ln       net.Listener
	clients  map[string][]string
	log      *zap.Logger
	requests *prometheus.CounterVec
	done     chan struct{}
	once     sync.Once
}

// identityKey is the context key of a request's client identity.
type identityKey struct{}

// TLSConfig is the server's TLS configuration as the files hold it now:
// TLS 1.3 only, a client certificate signed by one of the CAs of
// clientCAFile required. (The server itself reloads the files when they
// change.)
func TLSConfig(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	return load(certFile, keyFile, clientCAFile)
}

// Listen serves svc on opts.Listen until Close.
func Listen(svc *manage.Service, opts Options) (*Server, error) {
	if opts.MaxConns == 0 {
		opts.MaxConns = DefaultMaxConns
	}
	if opts.MaxStreams == 0 {
		opts.MaxStreams = DefaultMaxStreams
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if len(opts.Clients) == 0 {
		return nil, errors.New("management API: no clients: name at least one identity and its pools")
	}
	cs, err := newCerts(opts.CertFile, opts.KeyFile, opts.ClientCAFile, opts.Logger)
	if err != nil {
		return nil, fmt.Errorf("management API: %w", err)
	}
	// Every handshake takes the configuration of the files as they are
	// (a renewed certificate needs no restart).
	tc := &tls.Config{MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return cs.get(), nil }}
	s := &Server{clients: map[string][]string{}, log: opts.Logger, done: make(chan struct{}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "rblkd", Name: "manage_requests_total",
			Help: "Requests on the remote management API, by method and gRPC code."}, []string{"method", "code"})}
	for _, c := range opts.Clients {
		if c.Identity == "" {
			return nil, errors.New("management API: a client without an identity")
		}
		if _, dup := s.clients[c.Identity]; dup {
			return nil, fmt.Errorf("management API: client %q given twice", c.Identity)
		}
		s.clients[c.Identity] = slices.Clone(c.Pools)
	}
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(s.requests); err != nil {
			return nil, fmt.Errorf("management API: register metrics: %w", err)
		}
	}
	ln, err := net.Listen("tcp", opts.Listen)
	if err != nil {
		return nil, fmt.Errorf("management API: %w", err)
	}
	s.ln = ln
	s.srv = grpc.NewServer(
		grpc.Creds(credentials.NewTLS(tc)),
		grpc.ConnectionTimeout(10*time.Second),
		grpc.MaxRecvMsgSize(64<<10),
		grpc.MaxConcurrentStreams(uint32(opts.MaxStreams)),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second}),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: 5 * time.Minute, Time: time.Minute, Timeout: 20 * time.Second}),
		grpc.ChainUnaryInterceptor(s.authenticate),
	)
	managepb.RegisterManageServer(s.srv, &handlers{svc: svc, s: s})
	go func() {
		defer close(s.done)
		s.srv.Serve(netutil.LimitListener(ln, opts.MaxConns))
	}()
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server: the requests in progress get a few seconds to
// finish, then their connections are closed. It is safe to call twice.
func (s *Server) Close() {
	s.once.Do(func() {
		stopped := make(chan struct{})
		go func() { s.srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(5 * time.Second):
			s.srv.Stop()
		}
		<-s.done
	})
}

// authenticate finds the client of a request from its certificate, and
// counts and logs the request.
func (s *Server) authenticate(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (resp any, err error) {
	start := time.Now()
	id := ""
	defer func() {
		code := status.Code(err)
		s.requests.WithLabelValues(info.FullMethod, code.String()).Inc()
		if err != nil {
			s.log.Warn("management request failed", zap.String("method", info.FullMethod), zap.String("client", id),
				zap.String("code", code.String()), zap.String("error", status.Convert(err).Message()), zap.Duration("took", time.Since(start)))
		} else {
			s.log.Info("management request", zap.String("method", info.FullMethod), zap.String("client", id), zap.Duration("took", time.Since(start)))
		}
	}()
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, status.Error(codes.Unauthenticated, "no peer")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return nil, status.Error(codes.Unauthenticated, "no verified client certificate")
	}
	id = ti.State.VerifiedChains[0][0].Subject.CommonName
	if id == "" {
		return nil, status.Error(codes.Unauthenticated, "the client certificate names no client (an empty Common Name)")
	}
	if _, ok := s.clients[id]; !ok {
		return nil, status.Errorf(codes.PermissionDenied, "client %q may manage no pool (rblkd's management: clients:)", id)
	}
	return h(context.WithValue(ctx, identityKey{}, id), req)
}

// may reports whether the client of ctx may manage pool.
func (s *Server) may(ctx context.Context, pool string) bool {
	id, _ := ctx.Value(identityKey{}).(string)
	pools := s.clients[id]
	return slices.Contains(pools, AllPools) || slices.Contains(pools, pool)
}

// check refuses a request on a pool the client may not manage.
func (s *Server) check(ctx context.Context, pool string) error {
	if pool == "" {
		return status.Error(codes.InvalidArgument, "no pool given")
	}
	if !s.may(ctx, pool) {
		id, _ := ctx.Value(identityKey{}).(string)
		return status.Errorf(codes.PermissionDenied, "client %q may not manage pool %q", id, pool)
	}
	return nil
}

// grpcCodes maps the Service's codes to gRPC's (any other: Internal).
var grpcCodes = map[manage.Code]codes.Code{
	manage.InvalidArgument:    codes.InvalidArgument,
	manage.NotFound:           codes.NotFound,
	manage.AlreadyExists:      codes.AlreadyExists,
	manage.ResourceExhausted:  codes.ResourceExhausted,
	manage.FailedPrecondition: codes.FailedPrecondition,
	manage.PermissionDenied:   codes.PermissionDenied,
	manage.Unavailable:        codes.Unavailable,
	manage.DeadlineExceeded:   codes.DeadlineExceeded,
	manage.Canceled:           codes.Canceled,
}

// toStatus is err as a gRPC status.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	c, ok := grpcCodes[manage.CodeOf(err)]
	if !ok {
		c = codes.Internal
	}
	return status.Error(c, err.Error())
}
