package initiator_test

import (
	"os"
	"testing"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
)

// testProvider is the transport the initiator's tests run over, and the
// address their targets listen on: the software provider on loopback, or,
// when RBLK_INITIATOR_TRANSPORT=rdma and the test binary is built with
// -tags rdma (the soak in the guest of vm/), the verbs provider on
// RBLK_RDMA_ADDR. (The target's tests have the same switch:
// RBLK_TARGET_TRANSPORT.)
func testProvider(t *testing.T) (transport.Provider, string) {
	t.Helper()
	if os.Getenv("RBLK_INITIATOR_TRANSPORT") == "rdma" {
		return rdmaProvider(t)
	}
	return tcp.New("tcp"), "127.0.0.1:0"
}

// tcpOnly skips t over rdma (RBLK_INITIATOR_TRANSPORT=rdma), saying why: for
// a test whose fault is made of the software transport's TCP.
func tcpOnly(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("RBLK_INITIATOR_TRANSPORT") == "rdma" {
		t.Skip("NOT APPLICABLE over rdma: tcp-only: " + why)
	}
}
