// Package cni is the CNI side of kvipam: the kvipam plugin (a veth per pod,
// routed /32 and /128 addresses, and a synchronous endpoint create on the
// node's agent) and the kvipam-ipam plugin (the same allocations as a CNI
// IPAM plugin for bridge, macvlan or ipvlan).
//
// The commands in cmd/kvipam and cmd/kvipam-ipam are thin: they hand
// NewPlugin().Funcs() or NewIPAM().Funcs() to skel.PluginMainFuncs.
// Everything the plugins decide lives here: configuration and CNI_ARGS
// parsing, the pod's network set-up through netlink (CreatePodVeth, then
// PodVeth.Configure), the calls to the node agent (Agent; the agent's
// contract is agent/api), the CNI results for every supported cniVersion,
// and the mapping of failures to CNI error codes (Code).
//
// A plugin runs in the node's ("host") network namespace. It enters the
// pod's namespace only through netlink handles bound to it, or through
// pkg/ns when it must write a sysctl there, and writes sysctls only for the
// interfaces it creates.
package cni
