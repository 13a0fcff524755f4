package remote

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// CheckInterval is how often, at most, the server looks at its
// certificate, key and client CA files for a change (on a handshake); a
// variable for tests.
var CheckInterval = time.Second

// fileStamp tells a file's version apart: a rename over it (a new inode)
// or a write in place (size, modification time).
type fileStamp struct {
	dev, ino uint64
	size     int64
	mtime    time.Time
}

func stampOf(path string) (fileStamp, error) {
	st, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	s := fileStamp{size: st.Size(), mtime: st.ModTime()}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		s.dev, s.ino = uint64(sys.Dev), sys.Ino
	}
	return s, nil
}

// reloading is a value made from files, made again when they change: it
// looks at them, at most once every CheckInterval, when the value is
// asked for (a handshake). Files that do not load (half written, a key
// that does not match its certificate) leave the last good value in use,
// said once through failed, until they do.
type reloading[T any] struct {
	files    []string
	load     func() (T, error)
	reloaded func()      // (may be nil)
	failed   func(error) // (may be nil)

	mu      sync.Mutex
	checked time.Time
	stamps  []fileStamp
	v       T
	failing bool // the files changed and did not load
}

func newReloading[T any](files []string, load func() (T, error)) (*reloading[T], error) {
	r := &reloading[T]{files: files, load: load}
	stamps, err := r.stampAll()
	if err != nil {
		return nil, err
	}
	if r.v, err = load(); err != nil {
		return nil, err
	}
	r.stamps, r.checked = stamps, time.Now()
	return r, nil
}

func (r *reloading[T]) stampAll() ([]fileStamp, error) {
	s := make([]fileStamp, len(r.files))
	for i, f := range r.files {
		st, err := stampOf(f)
		if err != nil {
			return nil, err
		}
		s[i] = st
	}
	return s, nil
}

// get is the current value, made again first if a file changed since the
// last look.
func (r *reloading[T]) get() T {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.checked) < CheckInterval {
		return r.v
	}
	r.checked = time.Now()
	stamps, err := r.stampAll()
	if err == nil && slices.Equal(stamps, r.stamps) {
		return r.v
	}
	if err == nil {
		var v T
		if v, err = r.load(); err == nil {
			r.v, r.stamps, r.failing = v, stamps, false
			if r.reloaded != nil {
				r.reloaded()
			}
			return r.v
		}
	}
	if !r.failing {
		r.failing = true
		if r.failed != nil {
			r.failed(err)
		}
	}
	return r.v
}

// newCerts is the server's TLS configuration from its files, made again
// when they change: a renewed certificate (or CA bundle) takes effect on
// the next connection, without a restart.
func newCerts(certFile, keyFile, caFile string, log *zap.Logger) (*reloading[*tls.Config], error) {
	r, err := newReloading([]string{certFile, keyFile, caFile}, func() (*tls.Config, error) { return load(certFile, keyFile, caFile) })
	if err != nil {
		return nil, err
	}
	r.reloaded = func() {
		log.Info("management API: certificates reloaded", zap.String("cert", certFile), zap.String("client_ca", caFile))
	}
	r.failed = func(err error) {
		log.Warn("management API: the changed certificate files do not load; serving with the previous ones", zap.Error(err))
	}
	return r, nil
}

// load makes the server's TLS configuration from the files: TLS 1.3
// only, a client certificate signed by one of the CAs of caFile required.
func load(certFile, keyFile, caFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("server certificate: %w", err)
	}
	cas, err := loadCAs(caFile)
	if err != nil {
		return nil, fmt.Errorf("client CA: %w", err)
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: cas, NextProtos: []string{"h2"}}, nil
}

func loadCAs(file string) (*x509.CertPool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	cas := x509.NewCertPool()
	if !cas.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("%s: no PEM certificate in it", file)
	}
	return cas, nil
}
