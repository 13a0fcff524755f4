//go:build linux && failpoints

package rdma

import (
	"os"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// FailpointsBuilt reports whether this build has failpoints (the tag
// failpoints): FailpointsEnv then injects faults into the verbs provider.
const FailpointsBuilt = true

// withFailpoints returns stack with the faults FailpointsEnv names
// injected (stack itself when it names none), and the failpoints.
func withFailpoints(stack verbs.Stack, log *zap.Logger) (verbs.Stack, *failpoints, error) {
	spec := os.Getenv(FailpointsEnv)
	if spec == "" {
		return stack, nil, nil
	}
	fp, err := parseFailpoints(spec, log)
	if err != nil {
		return nil, nil, err
	}
	log.Warn("rdma failpoints on: faults will be injected", zap.String("spec", spec), zap.Uint64("seed", fp.seed))
	return fp.wrap(stack), fp, nil
}
