// Package doctor checks what rblkd and rblk-attach need on this host, as
// `rblkd doctor` and `rblk-attach doctor` print it: RDMA devices, their
// ports, GIDs and MTU, the memlock limit, the verbs device nodes and
// rdma-core's libraries, the clock; for the target its listen address, auth
// file, target ID, backing files and memory for the cache; for the
// initiator the nbd and ublk drivers, free NBD devices, its host ID and
// secret files and the target's reachability.
//
// A check is data (Check): its name, whether it passed, whether a failure
// makes the run fail (Needed: the RDMA checks are needed only with
// --transport rdma; with auto they are reported, not needed), what was
// found and what to do about a failure, in plain language.
//
// The checks read the machine through the roots of an Env (/sys, /proc,
// /dev, /lib/modules, the library folders), so tests build fixture trees
// of real files in a temporary folder; DefaultEnv reads the real machine.
package doctor
