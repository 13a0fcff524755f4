package rdma

import (
	"fmt"

	"github.com/rblk/rblk/transport"
)

func newProvider(devs []string) (transport.Provider, error) {
	return nil, fmt.Errorf("RDMA devices %v found, but %w: this build has no verbs provider yet; use --transport tcp", devs, transport.ErrUnsupported)
}
