// Command kvipam is kvipam's CNI plugin: a veth per pod with routed /32
// and /128 addresses, and a synchronous endpoint create on the node's
// kvipam agent. See package cni and deploy/cni/README.md.
//
// The runtime's cgroup-aware GOMAXPROCS is off: it reads
// /proc/self/mountinfo at every start, which on a node with a hundred pods
// holds hundreds of mounts, and a plugin lives for one call.
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
