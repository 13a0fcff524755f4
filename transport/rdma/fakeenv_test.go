//go:build linux

package rdma

import (
	"net/netip"
	"testing"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

// fakeListenAddr is an address to listen on over the fake device.
var fakeListenAddr = netip.AddrPortFrom(fakeAddr, 0).String()

// newFakeProvider returns the provider over f with opts (defaults for the
// zero fields, no logging unless opts has a logger).
func newFakeProvider(t testing.TB, f *fakeFabric, opts Options) *provider {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	o, err := opts.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	p, err := newProviderOn(f, []string{fakeDevName}, o)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// deviceOrFake returns a provider over the RDMA device and the address
// to listen on, where there is one (a build with the tag rdma), else the
// provider over a fake device of its own.
func deviceOrFake(tb testing.TB, opts Options) (transport.Provider, string) {
	tb.Helper()
	if Supported && len(Devices()) > 0 {
		return testProvider(tb, opts)
	}
	tb.Logf("no RDMA device: over the fake device")
	return newFakeProvider(tb, newFakeFabric(tb), opts), fakeAddr.String()
}

// fakePair connects a (dialed) and b (accepted) through p over the fake
// device; they are closed when t ends.
func fakePair(t testing.TB, p *provider) (a, b *conn) {
	t.Helper()
	ca, cb := transporttest.Connect(t, p, fakeListenAddr)
	return ca.(*conn), cb.(*conn)
}

// fakeQPOf returns the fake QP of c.
func fakeQPOf(c *conn) *fakeQP { return c.qp.(*fakeQP) }

// heldConn is a connected conn over a fake device whose QP is held (it
// takes requests and does nothing with them: the test completes them by
// calling complete), with queues of sq and rq and chains of chunk.
func heldConn(t *testing.T, opts Options, chunk int) (*conn, *fakeFabric) {
	t.Helper()
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, opts)
	if chunk > 0 {
		p.chunk = chunk
	}
	a, _ := fakePair(t, p)
	qp := fakeQPOf(a)
	qp.setHold(true)
	// Before the conns close: the QP flushes what it held.
	t.Cleanup(func() { qp.setHold(false) })
	return a, f
}

// memory allocates n bytes outside the Go heap, freed when t ends.
func memory(t testing.TB, n int) []byte {
	t.Helper()
	m, err := transport.AllocMemory(n, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Free() })
	return m.Bytes()
}

// TestFakeConformance runs the provider's conformance suite over the fake
// device: the connection setup, data path, windows and signaling tests
// that the guest runs over Soft-RoCE.
func TestFakeConformance(t *testing.T) {
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	transporttest.RunProvider(t, p, func(*testing.T) string { return fakeListenAddr })
}
