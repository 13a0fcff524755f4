//go:build !rdma

package target_test

import (
	"testing"

	"github.com/rblk/rblk/transport"
)

func rdmaProvider(t *testing.T) (transport.Provider, string) {
	t.Fatal("RBLK_TARGET_TRANSPORT=rdma: this test binary was built without -tags rdma")
	return nil, ""
}
