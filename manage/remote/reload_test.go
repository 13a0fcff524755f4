package remote_test

import (
	"crypto/tls"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/rblk/rblk/manage/managepb"
	"github.com/rblk/rblk/manage/remote"
)

// replace puts b at path the way cert-manager or a deploy tool does: a
// new file renamed over the old one.
func replace(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path+".new", b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
}

// serverSerial is the serial number of the certificate the server shows
// on a new connection.
func (e *env) serverSerial(tc *tls.Config) *big.Int {
	e.t.Helper()
	c, err := tls.Dial("tcp", e.addr, tc)
	if err != nil {
		e.t.Fatalf("handshake: %v", err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber
}

// TestCertificatesReload: a renewed server certificate is shown on the
// next connection without a restart, and requests go on; a certificate
// file that does not load (half written) leaves the last good one in
// use. A client's renewed certificate is presented on its next
// connection: here one of another identity, whose requests the server
// then authorizes as that identity's. (Not parallel: it sets
// CheckInterval.)
func TestCertificatesReload(t *testing.T) {
	defer func(d time.Duration) { remote.CheckInterval = d }(remote.CheckInterval)
	remote.CheckInterval = 0
	e := start(t)
	caFile := filepath.Join(e.pki.dir, "ca.crt")
	cert, key := e.pki.issue("csi-controller", nil, true)
	tc, err := remote.ClientTLS(cert, key, caFile, "localhost")
	if err != nil {
		t.Fatal(err)
	}
	first := e.serverSerial(tc)

	c, k, err := e.pki.ca.Issue("storage-1", []string{"localhost", "127.0.0.1"}, false, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(e.pki.dir, "storage-1.crt"), filepath.Join(e.pki.dir, "storage-1.key")
	replace(t, keyFile, k)
	replace(t, certFile, c)
	renewed := e.serverSerial(tc)
	if renewed.Cmp(first) == 0 {
		t.Fatalf("the server still shows certificate %v after it was renewed", first)
	}
	if _, err := e.dial(tc).ListPools(ctx(t), &managepb.ListPoolsRequest{}); err != nil {
		t.Fatalf("a request after the renewal: %v", err)
	}

	// Half written: the old one stays.
	replace(t, certFile, c[:len(c)/2])
	if got := e.serverSerial(tc); got.Cmp(renewed) != 0 {
		t.Fatalf("after a half-written certificate the server shows %v, want the last good one %v", got, renewed)
	}
	if _, err := e.dial(tc).ListPools(ctx(t), &managepb.ListPoolsRequest{}); err != nil {
		t.Fatalf("a request with the half-written certificate file: %v", err)
	}

	// The client's certificate renewed, as tenant-slow: a new connection
	// presents it.
	if _, err := e.dial(tc).ListVolumes(ctx(t), &managepb.ListVolumesRequest{Pool: "fast"}); err != nil {
		t.Fatalf("csi-controller lists pool fast: %v", err)
	}
	tc2, k2, err := e.pki.ca.Issue("tenant-slow", nil, true, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	replace(t, key, k2)
	replace(t, cert, tc2)
	_, err = e.dial(tc).ListVolumes(ctx(t), &managepb.ListVolumesRequest{Pool: "fast"})
	wantCode(t, "pool fast with the client certificate renewed as tenant-slow", err, codes.PermissionDenied)
}
