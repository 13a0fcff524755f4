//go:build linux && cgo && rdma

package rdma

import (
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// Supported reports whether this build has the verbs provider (the build
// tag rdma, on linux with cgo).
const Supported = true

// newProvider returns the provider over librdmacm and libibverbs (with
// the faults of FailpointsEnv injected in a build with failpoints).
func newProvider(devs []string, opts Options) (transport.Provider, error) {
	stack, fp, err := withFailpoints(verbs.Open(), opts.Logger)
	if err != nil {
		return nil, err
	}
	p, err := newProviderOn(stack, devs, opts)
	if err != nil {
		return nil, err
	}
	p.fp = fp
	return p, nil
}
