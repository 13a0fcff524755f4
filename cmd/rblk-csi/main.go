// Command rblk-csi is rblk's CSI driver for Kubernetes: its controller
// provisions volumes in rblkd's storage pools through their management
// API; its node side attaches them (see package csidriver).
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "rblk-csi:", err)
		os.Exit(1)
	}
}
