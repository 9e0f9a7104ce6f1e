// Command kvipam-ipam is kvipam as a CNI IPAM plugin, for bridge, macvlan,
// ipvlan and other main plugins: "ipam": {"type": "kvipam-ipam"}. See
// package cni and deploy/cni/README.md.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/kvipam/kvipam/cni"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	skel.PluginMainFuncs(cni.NewIPAM().Funcs(), cni.VersionInfo(), "CNI IPAM plugin kvipam-ipam "+version)
}
