//go:build !rdma

package e2e

import (
	"errors"

	"github.com/rblk/rblk/transport"
)

// rdmaBuilt: this test binary has the verbs provider (-tags rdma).
const rdmaBuilt = false

func rdmaProvider() (transport.Provider, error) {
	return nil, errors.New("this test binary was built without -tags rdma")
}
