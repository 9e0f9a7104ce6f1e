package cni

import (
	"crypto/sha256"
	"encoding/hex"

	"github.com/kvipam/kvipam/agent/api"
)

// HostVethPrefix starts the name of every host-side veth kvipam creates.
const HostVethPrefix = api.HostVethPrefix

// HostVethName is the host-side veth of the attachment (containerID,
// ifName): "kv" and 11 hex digits of a SHA-256 of its owner key
// (api.Owner.Key), 13 characters, so within the kernel's 15. It is stable, so DEL finds the veth without any
// saved state, even after the pod's netns is gone.
func HostVethName(containerID, ifName string) string {
	h := sha256.Sum256([]byte(api.Owner{ContainerID: containerID, IfName: ifName}.Key()))
	return HostVethPrefix + hex.EncodeToString(h[:6])[:11]
}
