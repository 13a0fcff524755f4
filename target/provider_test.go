package target_test

import (
	"os"
	"testing"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
)

// testProvider is the transport the target's tests run over, and the
// address it listens on: the software provider on loopback, or, when
// RBLK_TARGET_TRANSPORT=rdma and the test binary is built with -tags rdma
// (the guest's verbs scenario), the verbs provider on RBLK_RDMA_ADDR.
func testProvider(t *testing.T) (transport.Provider, string) {
	t.Helper()
	if os.Getenv("RBLK_TARGET_TRANSPORT") == "rdma" {
		p, addr := rdmaProvider(t)
		return p, addr
	}
	return tcp.New("tcp"), "127.0.0.1:0"
}
