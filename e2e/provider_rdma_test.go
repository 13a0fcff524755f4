//go:build rdma

package e2e

import (
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma"
)

// rdmaBuilt: this test binary has the verbs provider (-tags rdma).
const rdmaBuilt = true

// rdmaProvider is the verbs provider, for in-process clients of rblkd over
// RBLK_E2E_TRANSPORT=rdma.
func rdmaProvider() (transport.Provider, error) { return rdma.New() }
