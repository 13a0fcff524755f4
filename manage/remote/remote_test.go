package remote_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"math/big"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/manage"
	"github.com/rblk/rblk/manage/managepb"
	"github.com/rblk/rblk/manage/remote"
	"github.com/rblk/rblk/pool"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/transporttest"
)

// pki is a CA and the files of the certificates it issued, in dir.
type pki struct {
	t   *testing.T
	dir string
	ca  *remote.CA
}

func newPKI(t *testing.T, name string) *pki {
	ca, err := remote.NewCA(name, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	p := &pki{t: t, dir: t.TempDir(), ca: ca}
	c, k, err := ca.PEM()
	if err != nil {
		t.Fatal(err)
	}
	p.write("ca.crt", c)
	p.write("ca.key", k)
	return p
}

func (p *pki) write(name string, b []byte) string {
	path := filepath.Join(p.dir, name)
	if err := remote.WriteNew(path, b, 0o600); err != nil {
		p.t.Fatal(err)
	}
	return path
}

// issue writes a certificate for name and returns its files.
func (p *pki) issue(name string, hosts []string, client bool) (cert, key string) {
	c, k, err := p.ca.Issue(name, hosts, client, time.Hour)
	if err != nil {
		p.t.Fatal(err)
	}
	return p.write(name+".crt", c), p.write(name+".key", k)
}

// issueNoName writes a client certificate with an empty subject.
func (p *pki) issueNoName() (cert, key string) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		p.t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca.Cert, &k.PublicKey, p.ca.Key)
	if err != nil {
		p.t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		p.t.Fatal(err)
	}
	return p.write("noname.crt", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})),
		p.write("noname.key", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}))
}

// env is a target with pools "fast" and "slow", and the management API on
// loopback.
type env struct {
	t    *testing.T
	pki  *pki
	srv  *remote.Server
	reg  *prometheus.Registry
	addr string
}

func start(t *testing.T) *env {
	transporttest.CheckGoroutines(t)
	tg, err := target.New(target.Options{CacheSize: 4 << 20, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tg.Close() })
	dir := t.TempDir()
	var pools []*pool.Pool
	for _, c := range []pool.Config{{Name: "fast", Dir: filepath.Join(dir, "fast"), Capacity: 8 << 20}, {Name: "slow", Dir: filepath.Join(dir, "slow")}} {
		p, err := pool.Open(c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		pools = append(pools, p)
	}
	svc, err := manage.New(context.Background(), tg, pools, manage.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pk := newPKI(t, "rblk test CA")
	cert, key := pk.issue("storage-1", []string{"localhost", "127.0.0.1"}, false)
	reg := prometheus.NewRegistry()
	srv, err := remote.Listen(svc, remote.Options{Listen: "127.0.0.1:0", CertFile: cert, KeyFile: key, ClientCAFile: filepath.Join(pk.dir, "ca.crt"),
		Clients:    []remote.Client{{Identity: "csi-controller", Pools: []string{remote.AllPools}}, {Identity: "tenant-slow", Pools: []string{"slow"}}},
		Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	return &env{t: t, pki: pk, srv: srv, reg: reg, addr: srv.Addr()}
}

// client dials as the holder of cert and key, trusting the server's CA.
func (e *env) client(cert, key string) managepb.ManageClient {
	tc, err := remote.ClientTLS(cert, key, filepath.Join(e.pki.dir, "ca.crt"), "localhost")
	if err != nil {
		e.t.Fatal(err)
	}
	return e.dial(tc)
}

func (e *env) dial(tc *tls.Config) managepb.ManageClient {
	c, cc, err := remote.Dial(e.addr, tc)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { cc.Close() })
	return c
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

func wantCode(t *testing.T, what string, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Errorf("%s: %v (%s), want %s", what, err, got, want)
	} else if want != codes.OK && status.Convert(err).Message() == "" {
		t.Errorf("%s: %s without a message", what, got)
	}
}

func TestManage(t *testing.T) {
	e := start(t)
	c := e.client(e.pki.issue("csi-controller", nil, true))
	cx := ctx(t)
	cr, err := c.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "pvc-1", SizeBytes: 4 << 20})
	if err != nil || !cr.Created || cr.Volume.Export != "fast:pvc-1" || cr.Volume.SizeBytes != 4<<20 {
		t.Fatalf("create: %v, %v", cr, err)
	}
	again, err := c.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "pvc-1", SizeBytes: 4 << 20})
	if err != nil || again.Created {
		t.Fatalf("create again: %v, %v; want found, not created", again, err)
	}
	pr, err := c.PublishVolume(cx, &managepb.PublishVolumeRequest{Pool: "fast", Name: "pvc-1", HostId: "node-a"})
	if err != nil || len(pr.Volume.Hosts) != 1 || pr.Volume.Hosts[0] != "node-a" {
		t.Fatalf("publish: %v, %v", pr, err)
	}
	if ur, err := c.UnpublishVolume(cx, &managepb.UnpublishVolumeRequest{Pool: "fast", Name: "pvc-1", HostId: "node-a"}); err != nil || ur.SessionsFenced != 0 {
		t.Fatalf("unpublish: %v, %v", ur, err)
	}
	er, err := c.ExpandVolume(cx, &managepb.ExpandVolumeRequest{Pool: "fast", Name: "pvc-1", SizeBytes: 6 << 20})
	if err != nil || er.Volume.SizeBytes != 6<<20 {
		t.Fatalf("expand: %v, %v", er, err)
	}
	lp, err := c.ListPools(cx, &managepb.ListPoolsRequest{})
	if err != nil || len(lp.Pools) != 2 || lp.Pools[0].Name != "fast" || lp.Pools[0].AvailableBytes != 2<<20 {
		t.Fatalf("pools: %v, %v", lp, err)
	}
	for _, r := range []struct {
		what string
		err  error
		want codes.Code
	}{
		{"create with '/'", second(c.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "a/b", SizeBytes: 4096})), codes.InvalidArgument},
		{"create with ..", second(c.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "..", SizeBytes: 4096})), codes.InvalidArgument},
		{"create without a pool", second(c.CreateVolume(cx, &managepb.CreateVolumeRequest{Name: "x", SizeBytes: 4096})), codes.InvalidArgument},
		{"create in no such pool", second(c.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "nope", Name: "x", SizeBytes: 4096})), codes.NotFound},
		{"create with another size", second(c.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "pvc-1", SizeBytes: 4096})), codes.AlreadyExists},
		{"create past capacity", second(c.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "big", SizeBytes: 4 << 20})), codes.ResourceExhausted},
		{"publish an empty host", second(c.PublishVolume(cx, &managepb.PublishVolumeRequest{Pool: "fast", Name: "pvc-1"})), codes.InvalidArgument},
		{"get an unknown volume", second(c.GetVolume(cx, &managepb.GetVolumeRequest{Pool: "fast", Name: "nope"})), codes.NotFound},
	} {
		wantCode(t, r.what, r.err, r.want)
	}
	if _, err := c.DeleteVolume(cx, &managepb.DeleteVolumeRequest{Pool: "fast", Name: "pvc-1"}); err != nil {
		t.Fatal(err)
	}
	_, err = c.DeleteVolume(cx, &managepb.DeleteVolumeRequest{Pool: "fast", Name: "pvc-1"})
	wantCode(t, "delete again", err, codes.NotFound)
	if n, _ := metricstest.Sum(t, e.reg, "rblkd_manage_requests_total"); n < 10 {
		t.Errorf("rblkd_manage_requests_total = %v, want every request counted", n)
	}
}

// TestAuthorization: a client manages its pools only; a certificate of no
// configured client, or naming none, gets nothing done.
func TestAuthorization(t *testing.T) {
	e := start(t)
	cx := ctx(t)
	tenant := e.client(e.pki.issue("tenant-slow", nil, true))
	_, err := tenant.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "x", SizeBytes: 4096})
	wantCode(t, "create in a pool of another client's", err, codes.PermissionDenied)
	if _, err := tenant.CreateVolume(cx, &managepb.CreateVolumeRequest{Pool: "slow", Name: "x", SizeBytes: 4096}); err != nil {
		t.Fatalf("create in its own pool: %v", err)
	}
	lp, err := tenant.ListPools(cx, &managepb.ListPoolsRequest{})
	if err != nil || len(lp.Pools) != 1 || lp.Pools[0].Name != "slow" {
		t.Fatalf("pools a tenant sees: %v, %v; want slow alone", lp, err)
	}
	stranger := e.client(e.pki.issue("stranger", nil, true))
	_, err = stranger.ListPools(cx, &managepb.ListPoolsRequest{})
	wantCode(t, "a client the server does not name", err, codes.PermissionDenied)
	noname := e.client(e.pki.issueNoName())
	_, err = noname.ListPools(cx, &managepb.ListPoolsRequest{})
	wantCode(t, "a certificate without a name", err, codes.Unauthenticated)
}

// TestNoValidCertificate: without a client certificate, with one of
// another CA, with a server certificate as a client's, or over TLS 1.2, a
// client gets no answer: the handshake fails, no request is served.
func TestNoValidCertificate(t *testing.T) {
	e := start(t)
	caFile := filepath.Join(e.pki.dir, "ca.crt")
	other := newPKI(t, "another CA")
	foreignCert, foreignKey := other.issue("csi-controller", nil, true)
	serverCert, serverKey := e.pki.issue("csi-controller-as-server", nil, false)
	good, err := remote.ClientTLS(serverCert, serverKey, caFile, "localhost") // (for its RootCAs)
	if err != nil {
		t.Fatal(err)
	}
	noCert := good.Clone()
	noCert.Certificates, noCert.GetClientCertificate = nil, nil
	foreign, err := remote.ClientTLS(foreignCert, foreignKey, caFile, "localhost")
	if err != nil {
		t.Fatal(err)
	}
	clientCert, clientKey := e.pki.issue("csi-controller", nil, true)
	tls12, err := remote.ClientTLS(clientCert, clientKey, caFile, "localhost")
	if err != nil {
		t.Fatal(err)
	}
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
	for name, tc := range map[string]*tls.Config{"no certificate": noCert, "another CA's": foreign, "a server certificate": good, "TLS 1.2": tls12} {
		c := e.dial(tc)
		cx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := c.ListPools(cx, &managepb.ListPoolsRequest{})
		cancel()
		if code := status.Code(err); code != codes.Unavailable && code != codes.DeadlineExceeded {
			t.Errorf("%s: %v (%s), want the connection refused (Unavailable)", name, err, code)
		}
	}
	if n, _ := metricstest.Sum(t, e.reg, "rblkd_manage_requests_total"); n != 0 {
		t.Errorf("rblkd_manage_requests_total = %v after clients without a valid certificate, want 0: none may reach a handler", n)
	}
}

func second[T any](_ T, err error) error { return err }
