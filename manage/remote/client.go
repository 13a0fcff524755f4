package remote

import (
	"crypto/tls"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/rblk/rblk/manage/managepb"
)

// ClientTLS is a client's TLS configuration: its certificate and key,
// and the CA certificates that sign servers' (PEM files). serverName,
// if not empty, is the name the server's certificate must carry (else
// the host of the address dialed). A renewed client certificate is
// taken on the next connection (the files are looked at, at most once
// every CheckInterval, when a server asks for it; files that do not load
// leave the last good one in use); a new CA file needs a new
// configuration.
func ClientTLS(certFile, keyFile, caFile, serverName string) (*tls.Config, error) {
	cas, err := loadCAs(caFile)
	if err != nil {
		return nil, fmt.Errorf("server CA: %w", err)
	}
	cc, err := newClientCert(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("client certificate: %w", err)
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, GetClientCertificate: cc.get, RootCAs: cas, ServerName: serverName}, nil
}

// clientCert is a client's certificate, reloaded from its files when
// they change.
type clientCert struct {
	certFile, keyFile string

	mu      sync.Mutex
	checked time.Time
	stamps  [2]fileStamp
	cert    *tls.Certificate
}

func newClientCert(certFile, keyFile string) (*clientCert, error) {
	c := &clientCert{certFile: certFile, keyFile: keyFile}
	stamps, err := c.stampAll()
	if err != nil {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	c.cert, c.stamps, c.checked = &cert, stamps, time.Now()
	return c, nil
}

func (c *clientCert) stampAll() ([2]fileStamp, error) {
	var s [2]fileStamp
	var err error
	if s[0], err = stampOf(c.certFile); err != nil {
		return s, err
	}
	s[1], err = stampOf(c.keyFile)
	return s, err
}

// get is tls.Config.GetClientCertificate.
func (c *clientCert) get(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Since(c.checked) < CheckInterval {
		return c.cert, nil
	}
	c.checked = time.Now()
	if stamps, err := c.stampAll(); err == nil && stamps != c.stamps {
		if cert, err := tls.LoadX509KeyPair(c.certFile, c.keyFile); err == nil {
			c.cert, c.stamps = &cert, stamps
		}
	}
	return c.cert, nil
}

// Dial returns a client of the management API at addr (HOST:PORT), over
// TLS with tc. The connection is made on the first request.
func Dial(addr string, tc *tls.Config) (managepb.ManageClient, *grpc.ClientConn, error) {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		return nil, nil, fmt.Errorf("management API at %s: %w", addr, err)
	}
	return managepb.NewManageClient(cc), cc, nil
}
