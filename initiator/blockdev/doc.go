// Package blockdev is the contract between a block-device front end (the
// NBD server of package nbd, the kernel's /dev/nbdX through it, a ublk
// queue) and the storage behind it (an rblk Volume): requests in, results
// out, with the backend's own memory for the data. Neither side imports
// the other; both import this package.
//
// A front end calls a Backend's methods concurrently, from as many
// requests as it has in flight. A Backend that also implements Submitter
// starts reads and writes without a goroutine per request and reports
// their end to a Completion, which the front end implements without
// allocating: the request's own pooled state.
package blockdev
