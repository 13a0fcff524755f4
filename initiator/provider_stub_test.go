//go:build !rdma

package initiator_test

import (
	"testing"

	"github.com/rblk/rblk/transport"
)

func rdmaProvider(t *testing.T) (transport.Provider, string) {
	t.Helper()
	t.Fatal("RBLK_INITIATOR_TRANSPORT=rdma: this test binary was built without -tags rdma")
	return nil, ""
}
