package cni

import (
	"crypto/sha256"
	"encoding/hex"
)

// HostVethPrefix starts the name of every host-side veth kvipam creates.
const HostVethPrefix = "kv"

// HostVethName is the host-side veth of the attachment (containerID,
// ifName): "kv" and 11 hex digits of a SHA-256 of both, 13 characters, so
// within the kernel's 15. It is stable, so DEL finds the veth without any
// saved state, even after the pod's netns is gone.
func HostVethName(containerID, ifName string) string {
	h := sha256.Sum256([]byte(containerID + "/" + ifName))
	return HostVethPrefix + hex.EncodeToString(h[:6])[:11]
}
