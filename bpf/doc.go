// Package bpf is kvipam's eBPF datapath: an anti-spoofing tc program on the
// host side of every pod's veth, the pinned maps that describe the node's
// endpoints, and the API the agent uses to attach, detach and adopt them.
//
// The program (kvipam.c) runs on the ingress of the host-side veth, so it sees
// every frame a pod sends, and drops IPv4, IPv6, ARP and NDP traffic that
// claims an address the pod does not own. Everything else returns
// TC_ACT_UNSPEC, so the program composes with other TCX programs.
//
// Everything lives under one pin directory on bpffs (by default
// /sys/fs/bpf/kvipam):
//
//	kvipam_addrs     hash: address -> {host ifindex, endpoint ID, MAC}
//	kvipam_ifaces    hash: host ifindex -> {endpoint ID, MAC, host ifname}
//	kvipam_counters  per-CPU hash: endpoint ID -> packets/bytes passed/dropped
//	kvipam_watch     hash: host ifindex -> flags, the veths whose announcements are reported
//	kvipam_announce  ring buffer: {ifindex, kind, family, address, MAC} per announcement
//	links/<ifindex>  the TCX link attaching the program to one host veth
//
// On a watched veth (the target of a live migration) the program also
// reports the guest's announcements that pass its checks: a gratuitous
// ARP, an unsolicited neighbor advertisement, a RARP frame (QEMU's
// announce_self). [Datapath.WatchAnnouncements] and
// [Datapath.Announcements] are the API; package agent/announce builds on
// them. Reporting never changes a verdict.
//
// Because maps and links are pinned, enforcement continues while the agent is
// not running, and a restarted agent adopts the endpoints without detaching
// them (see [Datapath.Adopt]).
package bpf
