// Package rdma is the transport provider over libibverbs and librdmacm
// (rdma-core): InfiniBand, RoCE, iWARP and Soft-RoCE.
//
// This build carries only device discovery and a stub that reports why it
// cannot connect; the verbs provider itself is to come (its cgo lives in one
// file behind build tags, with this stub beside it for builds without
// rdma-core).
package rdma
