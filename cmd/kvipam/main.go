// Command kvipam is kvipam's CNI plugin: a veth per pod with routed /32
// and /128 addresses, and a synchronous endpoint create on the node's
// kvipam agent. See package cni and deploy/cni/README.md.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/kvipam/kvipam/cni"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

func main() {
	skel.PluginMainFuncs(cni.NewPlugin().Funcs(), cni.VersionInfo(), "CNI plugin kvipam "+buildinfo.Read().String())
}
