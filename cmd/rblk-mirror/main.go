// Command rblk-mirror keeps a volume in two copies on two rblk targets:
// an md RAID1 over two rblk-attach devices, re-added when a copy comes
// back (see package mirror). It runs the same code as rblk-csi's node
// plugin: csidriver's attacher and package mirror.
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "rblk-mirror:", err)
		os.Exit(1)
	}
}
