package target

import (
	"context"
	"errors"
)

// Grow enlarges export name to size bytes online. TEMPORARY STUB so that
// this branch builds: the real one is in target/grow.go (another branch);
// the lead deletes this file at the merge.
func (t *Target) Grow(ctx context.Context, name string, size int64) error {
	return errors.New("grow: not implemented in this branch")
}
