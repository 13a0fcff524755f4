//go:build !(linux && cgo && rdma)

package rdma

import (
	"fmt"

	"github.com/rblk/rblk/transport"
)

// Supported reports whether this build has the verbs provider (the build
// tag rdma, on linux with cgo).
const Supported = false

func newProvider(devs []string, _ Options) (transport.Provider, error) {
	return nil, fmt.Errorf("RDMA devices %v found, but %w: %s; or use --transport tcp", devs, transport.ErrUnsupported, unsupportedHint)
}
