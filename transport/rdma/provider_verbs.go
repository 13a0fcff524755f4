//go:build linux && cgo && rdma

package rdma

import (
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// Supported reports whether this build has the verbs provider (the build
// tag rdma, on linux with cgo).
const Supported = true

// newProvider returns the provider over librdmacm and libibverbs.
func newProvider(devs []string, opts Options) (transport.Provider, error) {
	p, err := newProviderOn(verbs.Open(), devs, opts)
	if err != nil {
		return nil, err
	}
	return p, nil
}
