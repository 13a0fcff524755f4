// Package kubernetes holds rblk-csi's manifests (the YAML files beside
// this one) and their offline check (manifests_test.go): every object well
// formed, the names that must agree agreeing (the driver's name, the CSI
// socket of each sidecar, the service accounts and roles, the volumes
// mounted), and rblk-csi's arguments accepted by rblk-csi itself.
package kubernetes
