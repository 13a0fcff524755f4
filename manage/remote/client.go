package remote

import (
	"crypto/tls"
	"fmt"

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
	cert, err := newReloading([]string{certFile, keyFile}, func() (*tls.Certificate, error) {
		c, err := tls.LoadX509KeyPair(certFile, keyFile)
		return &c, err
	})
	if err != nil {
		return nil, fmt.Errorf("client certificate: %w", err)
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: cas, ServerName: serverName,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert.get(), nil }}, nil
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
