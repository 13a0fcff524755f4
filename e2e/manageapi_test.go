package e2e

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rblk/rblk/manage/managepb"
	"github.com/rblk/rblk/manage/remote"
)

// TestManagementAPI serves the management API of a real rblkd, with the
// certificates rblkd cert makes, and drives it as a remote client would:
// a volume created, published, written through rblk-attach by that host,
// unpublished (the attach fenced before the answer), deleted. Refused: a
// client without a certificate, with one of another CA, one the
// configuration does not name, a pool it may not manage, names with '/'
// or "..".
func TestManagementAPI(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	dir := t.TempDir()
	tlsDir := filepath.Join(dir, "tls")
	cert := func(args ...string) {
		mustRun(t, cmdTimeout, rblkdBin, append([]string{"cert"}, append(args, "--dir", tlsDir)...)...)
	}
	cert("ca")
	cert("server", "--name", "storage-1", "--host", "127.0.0.1")
	cert("client", "--name", "csi-controller")
	cert("client", "--name", "tenant")
	cert("client", "--name", "stranger")
	otherDir := filepath.Join(dir, "other-ca")
	mustRun(t, cmdTimeout, rblkdBin, "cert", "ca", "--dir", otherDir)
	mustRun(t, cmdTimeout, rblkdBin, "cert", "client", "--name", "csi-controller", "--dir", otherDir)

	apiAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := filepath.Join(dir, "rblkd.yaml")
	f := func(name string) string { return filepath.Join(tlsDir, name) }
	conf := fmt.Sprintf(`# rblkd.yaml of an e2e test
pools:
  - name: fast
    directory: %s
    capacity: 64M
  - name: other
    directory: %s
management:
  listen: %s
  cert: %s
  key: %s
  client_ca: %s
  clients:
    - identity: csi-controller
      pools: ["*"]
    - identity: tenant
      pools: [other]
`, filepath.Join(dir, "fast"), filepath.Join(dir, "other"), apiAddr, f("storage-1.crt"), f("storage-1.key"), f("ca.crt"))
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	tg := startTarget(t, nil, "--config", cfg)
	if err := waitUntil(tg.proc, 20*time.Second, func() bool { return strings.Contains(tg.out.String(), "management API") }); err != nil {
		t.Fatal(err)
	}
	client := func(certDir, name string) managepb.ManageClient {
		tc, err := remote.ClientTLS(filepath.Join(certDir, name+".crt"), filepath.Join(certDir, name+".key"), f("ca.crt"), "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		c, cc, err := remote.Dial(apiAddr, tc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return c
	}
	ctx, cancel := context.WithTimeout(context.Background(), patient(cmdTimeout))
	defer cancel()
	csi := client(tlsDir, "csi-controller")
	cr, err := csi.CreateVolume(ctx, &managepb.CreateVolumeRequest{Pool: "fast", Name: "pvc-7", SizeBytes: 16 << 20})
	if err != nil || !cr.Created || cr.Volume.Export != "fast:pvc-7" {
		t.Fatalf("create: %v, %v", cr, err)
	}
	if _, err := csi.PublishVolume(ctx, &managepb.PublishVolumeRequest{Pool: "fast", Name: "pvc-7", HostId: "node-a"}); err != nil {
		t.Fatal(err)
	}
	a := startAttach(t, tg, "fast:pvc-7", "--host-id", "node-a")
	qemuIO(t, a.uri(""), []qop{{kind: 'w', off: 0, n: 1 << 20, pattern: 0x5a}, {kind: 'f'}})
	ur, err := csi.UnpublishVolume(ctx, &managepb.UnpublishVolumeRequest{Pool: "fast", Name: "pvc-7", HostId: "node-a"})
	if err != nil || ur.SessionsFenced != 1 {
		t.Fatalf("unpublish: %v, %v; want node-a's session fenced", ur, err)
	}
	select {
	case <-a.done:
	case <-time.After(patient(stopTimeout)):
		t.Fatalf("rblk-attach of node-a still runs after its unpublish\n%s", a.out.String())
	}
	a.checkOutput(t)

	for _, c := range []struct {
		what string
		req  *managepb.CreateVolumeRequest
		want codes.Code
	}{
		{"a name with '/'", &managepb.CreateVolumeRequest{Pool: "fast", Name: "a/b", SizeBytes: 1 << 20}, codes.InvalidArgument},
		{"the name ..", &managepb.CreateVolumeRequest{Pool: "fast", Name: "..", SizeBytes: 1 << 20}, codes.InvalidArgument},
		{"a name with ../", &managepb.CreateVolumeRequest{Pool: "fast", Name: "../../x", SizeBytes: 1 << 20}, codes.InvalidArgument},
		{"past the capacity", &managepb.CreateVolumeRequest{Pool: "fast", Name: "big", SizeBytes: 64 << 20}, codes.ResourceExhausted},
		{"another size", &managepb.CreateVolumeRequest{Pool: "fast", Name: "pvc-7", SizeBytes: 32 << 20}, codes.AlreadyExists},
	} {
		if _, err := csi.CreateVolume(ctx, c.req); status.Code(err) != c.want {
			t.Errorf("create with %s: %v, want %s", c.what, err, c.want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "x.img")); err == nil {
		t.Error("a refused name wrote outside the pool")
	}
	tenant := client(tlsDir, "tenant")
	if _, err := tenant.DeleteVolume(ctx, &managepb.DeleteVolumeRequest{Pool: "fast", Name: "pvc-7"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("a tenant deleting in a pool not its own: %v, want PermissionDenied", err)
	}
	if _, err := client(tlsDir, "stranger").ListVolumes(ctx, &managepb.ListVolumesRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("a client the configuration does not name: %v, want PermissionDenied", err)
	}
	// No certificate, or one of another CA: the handshake fails, no answer.
	if _, err := client(otherDir, "csi-controller").ListVolumes(ctx, &managepb.ListVolumesRequest{}); status.Code(err) != codes.Unavailable {
		t.Errorf("a client certificate of another CA: %v, want the connection refused (Unavailable)", err)
	}
	conn, err := tls.Dial("tcp", apiAddr, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13})
	if err == nil {
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = conn.Read(make([]byte, 1)) // (TLS 1.3: the server's refusal comes after the client's handshake)
		conn.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a TLS client without a certificate: %v, want the handshake refused for want of one", err)
	}

	if _, err := csi.DeleteVolume(ctx, &managepb.DeleteVolumeRequest{Pool: "fast", Name: "pvc-7"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "fast", "pvc-7.img")); !os.IsNotExist(err) {
		t.Errorf("the volume's file after delete: %v", err)
	}
	tg.stop(t, stopTimeout)
}
