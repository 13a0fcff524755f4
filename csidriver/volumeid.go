package csidriver

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/pool"
)

// volumeID is a volume's ID: its target, pool and name in the pool.
type volumeID struct {
	Target, Pool, Name string
}

func (v volumeID) String() string { return v.Target + "/" + v.Pool + "/" + v.Name }

// parseVolumeID parses TARGET/POOL/NAME.
func parseVolumeID(s string) (volumeID, error) {
	parts := strings.Split(s, "/")
	if len(parts) != 3 || !targetName.MatchString(parts[0]) || !config.ValidPoolName(parts[1]) || pool.CheckName(parts[2]) != nil {
		return volumeID{}, fmt.Errorf("volume ID %q: want TARGET/POOL/NAME", s)
	}
	return volumeID{Target: parts[0], Pool: parts[1], Name: parts[2]}, nil
}

// volumeName is the pool's name for the CSI volume name: the name
// itself where a pool takes it, else "csi-" and a hash of it (the same
// for the same name: a retried CreateVolume finds its volume).
func volumeName(csiName string) string {
	if pool.CheckName(csiName) == nil {
		return csiName
	}
	sum := sha256.Sum256([]byte(csiName))
	return "csi-" + hex.EncodeToString(sum[:20])
}
