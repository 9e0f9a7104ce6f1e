// Command kvipam-ipam is kvipam as a CNI IPAM plugin, for bridge, macvlan,
// ipvlan and other main plugins: "ipam": {"type": "kvipam-ipam"}. See
// package cni and deploy/cni/README.md.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/kvipam/kvipam/cni"
	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

func main() {
	skel.PluginMainFuncs(cni.NewIPAM().Funcs(), cni.VersionInfo(), "CNI IPAM plugin kvipam-ipam "+buildinfo.Read().String())
}
