// Package e2e runs kvipam end to end as a container runtime would: the
// real kvipam, kvipam-ipam and kvipam-agent binaries, and the
// containernetworking plugins, invoked through libcni (and cnitool, from a
// script) in network namespaces the tests create. Each simulated node is a
// scratch "host" namespace running its own kvipam-agent, with an embedded
// etcd asked for by name (--etcd-embedded) unless the test gives an etcd
// cluster; nothing touches the real host's links, routes, sysctls or
// /var/lib/cni.
//
// The CRI tests (cri_test.go) drive a private containerd through the CRI,
// as kubelet does: it runs in a node's namespace and in a private mount
// namespace where scratch directories are mounted over /var/lib/cni and
// /run/containerd (which it uses whatever its configuration says; the
// host's get only empty mount-point directories if they had none), with a
// sandbox image built by the test. .ci/run installs containerd and runc.
//
// The BGP tests (bgp_test.go, frr_test.go) run Debian's FRR (zebra and
// bgpd) as the top-of-rack router in a router namespace the test makes,
// from a scratch directory, stopped by their pid files; they skip when
// FRR is not installed (.ci/run installs it, starting no service).
//
// The tests need root and skip without it. They build every binary once
// per run (go build from this module, so the versions are go.mod's).
// The agents run the routes datapath; KVIPAM_E2E_DATAPATH=bpf runs the
// same tests on the eBPF datapath (each node with its own bpffs pin
// directory, removed at the end).
//
// The package has only tests; this file holds its documentation.
package e2e
