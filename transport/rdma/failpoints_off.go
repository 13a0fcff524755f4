//go:build linux && !failpoints

package rdma

import (
	"os"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// FailpointsBuilt reports whether this build has failpoints (the tag
// failpoints): FailpointsEnv then injects faults into the verbs provider.
const FailpointsBuilt = false

// withFailpoints returns stack: this build has no failpoints. It says so
// if FailpointsEnv asks for some.
func withFailpoints(stack verbs.Stack, log *zap.Logger) (verbs.Stack, *failpoints, error) {
	if spec := os.Getenv(FailpointsEnv); spec != "" {
		log.Warn("rdma: "+FailpointsEnv+" is set, but this build has no failpoints (build with -tags rdma,failpoints); ignored", zap.String("spec", spec))
	}
	return stack, nil, nil
}
