// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * kvipam anti-spoofing filter.
 *
 * Attached to the ingress of the HOST side of a pod's veth, so it sees every
 * frame the pod sends. A frame whose network-layer source is not one of the
 * endpoint's addresses is dropped; everything else returns TC_ACT_UNSPEC so
 * that the next program (TCX) or filter (clsact) still runs.
 *
 * Enforced:
 *   IPv4  source address must belong to this interface.
 *   IPv6  source address must belong to this interface, or be link-local
 *         (fe80::/10), or be unspecified (::) in an ICMPv6 message (DAD's
 *         neighbor solicitations, MLD reports before a link-local exists).
 *   NDP   a neighbor advertisement's target must belong to this interface or
 *         be link-local, whatever the packet's source.
 *   ARP   Ethernet/IPv4 only; the sender protocol address must belong to this
 *         interface, or be 0.0.0.0 (an RFC 5227 probe, which updates no cache).
 *
 * An interface the program runs on but that has no entry in kvipam_ifaces
 * drops everything: the filter fails closed rather than open.
 *
 * Announcements. On an interface listed in kvipam_watch (the target of a
 * live migration), a guest's announcement that passes the checks above is
 * also reported in the kvipam_announce ring buffer: a gratuitous ARP (sender
 * protocol address = target protocol address), an unsolicited neighbor
 * advertisement (S flag clear) for an address of the interface, and a RARP
 * request or reply (QEMU's announce_self). Reporting never changes a
 * verdict.
 *
 * Host ports (hostport.h). A frame that passes the checks above and belongs
 * to a flow translated for a host port is translated back (the pod's reply
 * leaves with the node's address and host port), and a frame to one of the
 * node's addresses and a mapped host port is translated to the pod that
 * serves it (hairpin). kvipam_hostport_in (the uplinks' ingress) and
 * kvipam_hostport_local (lo's egress) translate the other hosts' and the
 * node's own connections.
 */

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <linux/ip.h>
#include <linux/ipv6.h>

char __license[] SEC("license") = "Dual BSD/GPL";

#define FAMILY_IPV4 4
#define FAMILY_IPV6 6

/* Extension headers walked before giving up on finding ICMPv6. */
#define MAX_IPV6_EXT 4

#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_DEST 60

#define ICMPV6_NEIGHBOR_ADVERT 136

#define ARPHRD_ETHER 1

/* RARP (QEMU's announce_self); linux/if_ether.h names it too, kept here so
 * the program does not depend on which header version declares it. */
#ifndef ETH_P_RARP
#define ETH_P_RARP 0x8035
#endif

#define RARP_OP_REQUEST 3
#define RARP_OP_REPLY 4

/* announce_event.kind */
#define ANNOUNCE_GARP 1
#define ANNOUNCE_NA 2
#define ANNOUNCE_RARP 3

/* The S (solicited) flag of a neighbor advertisement, in its first flags byte. */
#define NA_FLAG_SOLICITED 0x40

/* addr_key is an endpoint address. IPv4 uses the first 4 bytes of addr. */
struct addr_key {
	__u8 family; /* FAMILY_IPV4 or FAMILY_IPV6 */
	__u8 pad[3];
	__u8 addr[16];
};

/* addr_info says which endpoint owns an address. */
struct addr_info {
	__u32 ifindex; /* host-side veth */
	__u32 endpoint_id;
	__u8 mac[6]; /* pod-side MAC; informational, not enforced */
	__u8 pad[2];
};

/* iface_info describes the endpoint behind a host-side veth. */
struct iface_info {
	__u32 endpoint_id;
	__u8 mac[6];
	__u8 pad[2];
	char name[16]; /* host-side interface name, for the agent's restart */
};

/* counters are kept per endpoint and per CPU. */
struct counters {
	__u64 passed_packets;
	__u64 passed_bytes;
	__u64 dropped_packets;
	__u64 dropped_bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct addr_key);
	__type(value, struct addr_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kvipam_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32); /* ifindex */
	__type(value, struct iface_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kvipam_ifaces SEC(".maps");

/*
 * Entries are created by user space when an endpoint is attached (and entry 0,
 * for frames on an unknown interface, when the datapath is opened); the
 * program never inserts, so a detach cannot race with a re-insert.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 8192);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32); /* endpoint ID */
	__type(value, struct counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kvipam_counters SEC(".maps");

/* Host ifindexes whose announcements are reported; the value is reserved
 * for flags (user space writes 1). Written by user space only. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);   /* ifindex */
	__type(value, __u32); /* flags */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kvipam_watch SEC(".maps");

/* announce_event is one announcement seen on a watched interface. */
struct announce_event {
	__u32 ifindex; /* host-side veth */
	__u8 kind;     /* ANNOUNCE_GARP, ANNOUNCE_NA or ANNOUNCE_RARP */
	__u8 family;   /* FAMILY_IPV4, FAMILY_IPV6, or 0 for RARP */
	__u8 pad[2];
	__u8 addr[16]; /* the announced address; IPv4 in the first 4 bytes */
	__u8 mac[6];   /* sender hardware address */
	__u8 pad2[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 16);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kvipam_announce SEC(".maps");

static __always_inline int watched(__u32 ifindex)
{
	return bpf_map_lookup_elem(&kvipam_watch, &ifindex) != 0;
}

/* announce reports an announcement of addr (family 0: none) by mac. A full
 * ring buffer loses the event; the frame's verdict is the same. */
static __always_inline void announce(__u32 ifindex, __u8 kind, __u8 family, const __u8 *addr,
				     const __u8 *mac)
{
	struct announce_event ev = {.ifindex = ifindex, .kind = kind, .family = family};

	if (family)
		__builtin_memcpy(ev.addr, addr, 16);
	__builtin_memcpy(ev.mac, mac, ETH_ALEN);
	bpf_ringbuf_output(&kvipam_announce, &ev, sizeof(ev), 0);
}

static __always_inline int account(struct __sk_buff *skb, __u32 endpoint_id, int verdict)
{
	struct counters *c = bpf_map_lookup_elem(&kvipam_counters, &endpoint_id);

	if (c) {
		if (verdict == TC_ACT_SHOT) {
			c->dropped_packets++;
			c->dropped_bytes += skb->len;
		} else {
			c->passed_packets++;
			c->passed_bytes += skb->len;
		}
	}
	return verdict;
}

static __always_inline int owned(__u32 ifindex, struct addr_key *key)
{
	struct addr_info *info = bpf_map_lookup_elem(&kvipam_addrs, key);

	return info && info->ifindex == ifindex;
}

static __always_inline int ipv6_link_local(const __u8 *a)
{
	return a[0] == 0xfe && (a[1] & 0xc0) == 0x80;
}

static __always_inline int ipv6_unspecified(const __u8 *a)
{
	const __u32 *w = (const __u32 *)a;

	return (w[0] | w[1] | w[2] | w[3]) == 0;
}

static __always_inline int check_ipv4(struct __sk_buff *skb, __u32 ifindex)
{
	struct addr_key key = {.family = FAMILY_IPV4};

	/* saddr is at offset 12 of the IPv4 header. */
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 12, key.addr, 4) < 0)
		return TC_ACT_SHOT;
	return owned(ifindex, &key) ? TC_ACT_UNSPEC : TC_ACT_SHOT;
}

/* announce_arp reports an ARP request or reply from spa (owned) if it is
 * gratuitous: its target protocol address is spa too (arping -U and -A). */
static __always_inline void announce_arp(struct __sk_buff *skb, __u32 ifindex, const __u8 *spa)
{
	__u8 sha[ETH_ALEN];
	__u8 tpa[4];
	__u8 addr[16] = {};

	/* The target protocol address follows the sender's (hw, ip) and the
	 * target hardware address. */
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 8 + ETH_ALEN + 4 + ETH_ALEN, tpa, 4) < 0)
		return;
	if (tpa[0] != spa[0] || tpa[1] != spa[1] || tpa[2] != spa[2] || tpa[3] != spa[3])
		return;
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 8, sha, ETH_ALEN) < 0)
		return;
	__builtin_memcpy(addr, tpa, 4);
	announce(ifindex, ANNOUNCE_GARP, FAMILY_IPV4, addr, sha);
}

/* check_rarp never drops: a RARP frame carries no IP address to check. On a
 * watched interface a RARP request or reply (op 3 or 4) with Ethernet
 * addresses reports its sender hardware address. */
static __always_inline int check_rarp(struct __sk_buff *skb, __u32 ifindex)
{
	struct {
		__be16 hrd;
		__be16 pro;
		__u8 hln;
		__u8 pln;
		__be16 op;
		__u8 sha[ETH_ALEN];
	} rarp;

	if (!watched(ifindex) || bpf_skb_load_bytes(skb, ETH_HLEN, &rarp, sizeof(rarp)) < 0)
		return TC_ACT_UNSPEC;
	if (rarp.hln == ETH_ALEN &&
	    (rarp.op == bpf_htons(RARP_OP_REQUEST) || rarp.op == bpf_htons(RARP_OP_REPLY)))
		announce(ifindex, ANNOUNCE_RARP, 0, 0, rarp.sha);
	return TC_ACT_UNSPEC;
}

static __always_inline int check_arp(struct __sk_buff *skb, __u32 ifindex)
{
	struct addr_key key = {.family = FAMILY_IPV4};
	struct {
		__be16 hrd;
		__be16 pro;
		__u8 hln;
		__u8 pln;
		__be16 op;
	} arp;

	if (bpf_skb_load_bytes(skb, ETH_HLEN, &arp, sizeof(arp)) < 0)
		return TC_ACT_SHOT;
	if (arp.hrd != bpf_htons(ARPHRD_ETHER) || arp.pro != bpf_htons(ETH_P_IP) ||
	    arp.hln != ETH_ALEN || arp.pln != 4)
		return TC_ACT_SHOT;
	/* The sender protocol address follows the 8-byte header and the 6-byte
	 * sender hardware address. */
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 8 + ETH_ALEN, key.addr, 4) < 0)
		return TC_ACT_SHOT;
	if ((key.addr[0] | key.addr[1] | key.addr[2] | key.addr[3]) == 0)
		return TC_ACT_UNSPEC;
	if (!owned(ifindex, &key))
		return TC_ACT_SHOT;
	if (watched(ifindex))
		announce_arp(skb, ifindex, key.addr);
	return TC_ACT_UNSPEC;
}

/* announce_na reports the neighbor advertisement at off for target (owned)
 * if it is unsolicited. The sender hardware address is the frame's source. */
static __always_inline void announce_na(struct __sk_buff *skb, __u32 ifindex, __u32 off,
					const __u8 *target)
{
	__u8 flags;
	__u8 mac[ETH_ALEN];

	if (bpf_skb_load_bytes(skb, off + 4, &flags, 1) < 0 || (flags & NA_FLAG_SOLICITED))
		return;
	if (bpf_skb_load_bytes(skb, ETH_ALEN, mac, ETH_ALEN) < 0)
		return;
	announce(ifindex, ANNOUNCE_NA, FAMILY_IPV6, target, mac);
}

static __always_inline int check_ipv6(struct __sk_buff *skb, __u32 ifindex)
{
	struct addr_key key = {.family = FAMILY_IPV6};
	__u32 off = ETH_HLEN + 40; /* fixed IPv6 header */
	__u8 nexthdr;
	struct {
		__u8 nexthdr;
		__u8 hdrlen;
	} ext;
	__u8 type;
	int unspecified;

	/* nexthdr is at offset 6, saddr at offset 8 of the IPv6 header. */
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 6, &nexthdr, 1) < 0)
		return TC_ACT_SHOT;
	if (bpf_skb_load_bytes(skb, ETH_HLEN + 8, key.addr, 16) < 0)
		return TC_ACT_SHOT;
	unspecified = ipv6_unspecified(key.addr);
	if (!unspecified && !ipv6_link_local(key.addr) && !owned(ifindex, &key))
		return TC_ACT_SHOT;

	/* Find ICMPv6 behind hop-by-hop, routing and destination options
	 * headers, which the kernel skips before handing a packet to NDP. A
	 * fragment header ends the walk: the kernel ignores fragmented NDP
	 * (RFC 6980). */
#pragma unroll
	for (int i = 0; i < MAX_IPV6_EXT; i++) {
		if (nexthdr != NEXTHDR_HOP && nexthdr != NEXTHDR_ROUTING && nexthdr != NEXTHDR_DEST)
			break;
		if (bpf_skb_load_bytes(skb, off, &ext, sizeof(ext)) < 0)
			return TC_ACT_SHOT;
		nexthdr = ext.nexthdr;
		off += ((__u32)ext.hdrlen + 1) * 8;
	}
	/* A chain longer than we walk could hide an NDP message: fail closed. */
	if (nexthdr == NEXTHDR_HOP || nexthdr == NEXTHDR_ROUTING || nexthdr == NEXTHDR_DEST)
		return TC_ACT_SHOT;
	if (nexthdr != IPPROTO_ICMPV6)
		/* :: is a source only for DAD and MLD, both ICMPv6. */
		return unspecified ? TC_ACT_SHOT : TC_ACT_UNSPEC;

	if (bpf_skb_load_bytes(skb, off, &type, 1) < 0)
		return TC_ACT_SHOT;
	if (type != ICMPV6_NEIGHBOR_ADVERT)
		return TC_ACT_UNSPEC;
	/* The target follows the 8-byte ICMPv6 header of a neighbor advertisement. */
	if (bpf_skb_load_bytes(skb, off + 8, key.addr, 16) < 0)
		return TC_ACT_SHOT;
	if (ipv6_link_local(key.addr))
		return TC_ACT_UNSPEC;
	if (!owned(ifindex, &key))
		return TC_ACT_SHOT;
	if (watched(ifindex))
		announce_na(skb, ifindex, off, key.addr);
	return TC_ACT_UNSPEC;
}

#include "hostport.h"

SEC("tc")
int kvipam_ingress(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct iface_info *iface = bpf_map_lookup_elem(&kvipam_ifaces, &ifindex);
	__u32 endpoint_id;

	if (!iface)
		return account(skb, 0, TC_ACT_SHOT);
	endpoint_id = iface->endpoint_id;

	switch (skb->protocol) {
	case bpf_htons(ETH_P_IP):
		return account(skb, endpoint_id, hostport_pod(skb, check_ipv4(skb, ifindex)));
	case bpf_htons(ETH_P_IPV6):
		return account(skb, endpoint_id, hostport_pod(skb, check_ipv6(skb, ifindex)));
	case bpf_htons(ETH_P_ARP):
		return account(skb, endpoint_id, check_arp(skb, ifindex));
	case bpf_htons(ETH_P_RARP):
		return account(skb, endpoint_id, check_rarp(skb, ifindex));
	default:
		return account(skb, endpoint_id, TC_ACT_UNSPEC);
	}
}
