package csidriver

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/rblk/rblk/config"
	"github.com/rblk/rblk/mirror"
	"github.com/rblk/rblk/pool"
)

// maxVolumeID is the most bytes CSI allows in a volume ID (its size
// limit for strings).
const maxVolumeID = 128

// volumeID is a volume's ID: where its copies are (one; two for a volume
// of replicas: 2, a mirror) and its name, the same in each copy's pool.
//
// A volume of one copy is TARGET/POOL/NAME; a mirror is
// TARGET/POOL/TARGET/POOL/NAME, its copies in the order of their targets'
// names (one ID for one volume: ListVolumes finds the copies apart and
// names them the same).
type volumeID struct {
	Copies []copyID
	Name   string
}

// copyID is where a copy of a volume is: its target and pool.
type copyID struct {
	Target, Pool string
}

// Mirror reports whether the volume has two copies.
func (v volumeID) Mirror() bool { return len(v.Copies) == 2 }

func (v volumeID) String() string {
	var b strings.Builder
	for _, c := range v.Copies {
		b.WriteString(c.Target + "/" + c.Pool + "/")
	}
	return b.String() + v.Name
}

// parseVolumeID parses TARGET/POOL/NAME or TARGET/POOL/TARGET/POOL/NAME.
func parseVolumeID(s string) (volumeID, error) {
	parts := strings.Split(s, "/")
	bad := fmt.Errorf("volume ID %q: want TARGET/POOL/NAME, or TARGET/POOL/TARGET/POOL/NAME for two copies", s)
	if len(parts) != 3 && len(parts) != 5 {
		return volumeID{}, bad
	}
	v := volumeID{Name: parts[len(parts)-1]}
	if pool.CheckName(v.Name) != nil {
		return volumeID{}, bad
	}
	for i := 0; i+1 < len(parts); i += 2 {
		if !targetName.MatchString(parts[i]) || !config.ValidPoolName(parts[i+1]) {
			return volumeID{}, bad
		}
		v.Copies = append(v.Copies, copyID{Target: parts[i], Pool: parts[i+1]})
	}
	if v.Mirror() && v.Copies[0].Target >= v.Copies[1].Target {
		return volumeID{}, fmt.Errorf("volume ID %q: two copies on targets in the order of their names, on two targets", s)
	}
	return v, nil
}

// arrayName is the name of the md array of a mirror (/dev/md/NAME): its
// volume's name where md takes it, else "rblk-" and a hash of the ID.
func (v volumeID) arrayName() string {
	if mirror.CheckName(v.Name) == nil {
		return v.Name
	}
	sum := sha256.Sum256([]byte(v.String()))
	return "rblk-" + hex.EncodeToString(sum[:13])
}

// maxPlainName is the longest CSI volume name a pool's volume is named
// after as it is: longer ones are hashed (44 bytes), so that a volume ID
// keeps within maxVolumeID (Kubernetes names volumes pvc-UUID: 40).
const maxPlainName = 48

// volumeName is the pool's name for the CSI volume name: the name
// itself where a pool takes it and it is short, else "csi-" and a hash
// of it (the same for the same name: a retried CreateVolume finds its
// volume).
func volumeName(csiName string) string {
	if len(csiName) <= maxPlainName && pool.CheckName(csiName) == nil {
		return csiName
	}
	sum := sha256.Sum256([]byte(csiName))
	return "csi-" + hex.EncodeToString(sum[:20])
}
