package rdma

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/rblk/rblk/transport"
)

// SysfsDir is where the kernel lists RDMA devices.
const SysfsDir = "/sys/class/infiniband"

// Devices lists the RDMA devices the kernel knows (rxe0, mlx5_0, ...).
func Devices() []string {
	entries, err := os.ReadDir(SysfsDir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		out = append(out, filepath.Base(e.Name()))
	}
	sort.Strings(out)
	return out
}

// New returns the verbs provider. Without an RDMA device it fails with
// transport.ErrNoDevice and says what to do.
func New() (transport.Provider, error) {
	devs := Devices()
	if len(devs) == 0 {
		return nil, fmt.Errorf("%w: %s lists none; load a driver (for Soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev IFACE) or use --transport tcp", transport.ErrNoDevice, SysfsDir)
	}
	return newProvider(devs)
}
