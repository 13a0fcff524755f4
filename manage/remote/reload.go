package remote

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
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

// certs is the server's TLS configuration, made again from its files when
// they change: a renewed certificate (or CA bundle) takes effect on the
// next connection, without a restart. Files that do not load (half
// written, a key that does not match the certificate) leave the last good
// configuration in use, said once in the log, until they do.
type certs struct {
	certFile, keyFile, caFile string
	log                       *zap.Logger

	mu      sync.Mutex
	checked time.Time
	stamps  [3]fileStamp
	cfg     *tls.Config
	failing bool // the files changed and did not load
	reloads int  // (for tests)
}

func newCerts(certFile, keyFile, caFile string, log *zap.Logger) (*certs, error) {
	c := &certs{certFile: certFile, keyFile: keyFile, caFile: caFile, log: log}
	stamps, err := c.stampAll()
	if err != nil {
		return nil, err
	}
	cfg, err := load(certFile, keyFile, caFile)
	if err != nil {
		return nil, err
	}
	c.cfg, c.stamps, c.checked = cfg, stamps, time.Now()
	return c, nil
}

func (c *certs) stampAll() ([3]fileStamp, error) {
	var s [3]fileStamp
	for i, f := range []string{c.certFile, c.keyFile, c.caFile} {
		st, err := stampOf(f)
		if err != nil {
			return s, err
		}
		s[i] = st
	}
	return s, nil
}

// config is tls.Config.GetConfigForClient: the current configuration,
// reloaded first if a file changed since the last look.
func (c *certs) config(*tls.ClientHelloInfo) (*tls.Config, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Since(c.checked) < CheckInterval {
		return c.cfg, nil
	}
	c.checked = time.Now()
	stamps, err := c.stampAll()
	if err == nil && stamps == c.stamps {
		return c.cfg, nil
	}
	if err == nil {
		var cfg *tls.Config
		if cfg, err = load(c.certFile, c.keyFile, c.caFile); err == nil {
			c.cfg, c.stamps, c.failing = cfg, stamps, false
			c.reloads++
			c.log.Info("management API: certificates reloaded", zap.String("cert", c.certFile), zap.String("client_ca", c.caFile))
			return c.cfg, nil
		}
	}
	if !c.failing {
		c.failing = true
		c.log.Warn("management API: the changed certificate files do not load; serving with the previous ones", zap.Error(err))
	}
	return c.cfg, nil
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
