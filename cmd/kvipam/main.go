// Command kvipam is kvipam's CNI plugin: a veth per pod with routed /32
// and /128 addresses, and a synchronous endpoint create on the node's
// kvipam agent. See package cni and deploy/cni/README.md.
//
// The runtime's container-aware GOMAXPROCS is off: a plugin lives for one
// call, and the setting cost it at every start, the more the more mounts
// the node has (hundreds with a hundred pods): a VERSION exec with 422
// mounts took 1.9 ms of CPU with it off, 2.3-2.5 ms with it on.
//
//go:debug containermaxprocs=0
//go:debug updatemaxprocs=0
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/kvipam/kvipam/cni"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

func main() {
	skel.PluginMainFuncs(cni.NewPlugin().Funcs(), cni.VersionInfo(), "CNI plugin kvipam "+buildinfo.Read().String())
}
