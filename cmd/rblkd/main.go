// Command rblkd is the rblk storage target: it exports backing files and
// block devices as volumes to rblk-attach initiators over RDMA.
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "rblkd:", err)
		os.Exit(1)
	}
}
