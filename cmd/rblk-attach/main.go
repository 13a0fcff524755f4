// Command rblk-attach attaches a volume of an rblk target on this host and
// serves it as an NBD export (for qemu, fio, nbdfuse, nbd-client).
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "rblk-attach:", err)
		os.Exit(1)
	}
}
