// Package csidriver is rblk-csi's logic: a CSI driver (the Container
// Storage Interface, github.com/container-storage-interface/spec) whose
// controller provisions volumes in the storage pools of rblkd targets
// through their management API (package manage/remote), and whose node
// side attaches them with rblk-attach.
//
// The controller keeps no state. A volume's ID names its target, pool
// and volume ("TARGET/POOL/NAME"), and the inventory (Inventory) says how
// to reach each target; CreateVolume finds a volume it made before by
// name on every target, so a retried call returns the same volume.
//
// Publishing a volume to a node publishes it, on its target, to the
// node's host ID (the node ID is the host ID); unpublishing fences the
// node before it answers: its sessions closed, its keys dead, so that a
// pod can move off a dead node at once while nothing the dead node still
// sends lands.
package csidriver
