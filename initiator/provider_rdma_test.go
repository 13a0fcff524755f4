//go:build rdma

package initiator_test

import (
	"net"
	"os"
	"testing"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma"
)

func rdmaProvider(t *testing.T) (transport.Provider, string) {
	t.Helper()
	addr := os.Getenv("RBLK_RDMA_ADDR")
	if addr == "" {
		t.Fatal("RBLK_INITIATOR_TRANSPORT=rdma needs RBLK_RDMA_ADDR")
	}
	p, err := rdma.New()
	if err != nil {
		t.Fatal(err)
	}
	return p, net.JoinHostPort(addr, "0")
}
