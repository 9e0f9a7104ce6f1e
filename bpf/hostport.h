/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Host ports: a pod's portMappings served by the datapath (docs/design.md,
 * "Host ports"). Included by kvipam.c only.
 *
 * kvipam_hostports says which pod serves a host port: {family, protocol,
 * host port, host address (all zero: every address of the node)} -> the
 * pod's address and port. A frame to one of the node's addresses and a
 * mapped host port has its destination translated to the pod's (DNAT),
 * where it enters the node:
 *   - on an uplink's ingress (kvipam_hostport_in): other hosts;
 *   - on lo's egress (kvipam_hostport_local): the node's own processes;
 *     the frame is then sent to the pod's veth at once, since the kernel
 *     has already routed it to the node itself;
 *   - on a pod's veth ingress (kvipam_ingress, after the source check):
 *     pods of the node (hairpin). A pod that reaches its own host port
 *     also has its source translated to the address it dialed, as a pod
 *     drops a frame from its own address.
 * Each translation records the flow in kvipam_nat, keyed as the pod's
 * replies carry it; kvipam_ingress translates those replies back (source:
 * the node's address and host port; destination: the client). A
 * translated frame leaves by the interface the FIB names (forward), past
 * netfilter; one to the node itself goes up the stack, with one of the
 * node's addresses as its source, arriving on the pod's veth: the plugin
 * sets accept_local on the host veth of a pod with host ports (IPv4; IPv6
 * has no such check).
 *
 * TCP and UDP, IPv4 and IPv6 without extension headers; fragments are not
 * translated. kvipam_nat is an LRU: a flow's entry lives until the map
 * needs its room or the endpoint goes.
 */

#define IPV4_FRAG_MASK 0x3fff /* MF and the fragment offset */

/* hostport_key is a mapped host port. IPv4 uses the first 4 bytes of addr. */
struct hostport_key {
	__u8 family; /* FAMILY_IPV4 or FAMILY_IPV6 */
	__u8 proto;  /* IPPROTO_TCP or IPPROTO_UDP */
	__be16 port; /* host port */
	__u8 addr[16]; /* host address; all zero: every address of the node */
};

/* hostport_info is the pod that serves a host port. */
struct hostport_info {
	__u8 addr[16]; /* the pod's address */
	__be16 port;   /* the pod's port */
	__u8 pod_mac[6];
	__u8 host_mac[6]; /* the host-side veth's, for frames sent to it */
	__u8 pad[2];
	__u32 ifindex; /* host-side veth */
	__u32 endpoint_id;
};

/* nat_key is a translated flow as the pod's replies carry it. */
struct nat_key {
	__u8 family;
	__u8 proto;
	__be16 pod_port;
	__be16 peer_port;
	__u8 pad[2];
	__u8 pod_addr[16];
	__u8 peer_addr[16];
};

/* nat_info is what a reply is translated to. */
struct nat_info {
	__u8 host_addr[16];   /* the address the client dialed: the reply's source */
	__u8 client_addr[16]; /* the client's: the reply's destination */
	__be16 host_port;
	__be16 client_port;
	__u32 ifindex; /* the serving pod's host-side veth */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, struct hostport_key);
	__type(value, struct hostport_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kvipam_hostports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct nat_key);
	__type(value, struct nat_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} kvipam_nat SEC(".maps");

/* flow is a parsed TCP or UDP frame; addresses as in hostport_key. */
struct flow {
	__u8 family;
	__u8 proto;
	__be16 sport;
	__be16 dport;
	__u16 pad;
	__u32 l4; /* offset of the TCP or UDP header */
	__u8 saddr[16];
	__u8 daddr[16];
};

/* parse fills f from an Ethernet frame; 0 for a TCP or UDP frame that can
 * be translated, -1 for anything else. */
static __always_inline int parse(struct __sk_buff *skb, struct flow *f)
{
	__be16 ports[2];

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
			return -1;
		if (ip.ihl < 5 || (ip.frag_off & bpf_htons(IPV4_FRAG_MASK)))
			return -1;
		f->family = FAMILY_IPV4;
		f->proto = ip.protocol;
		f->l4 = ETH_HLEN + (__u32)ip.ihl * 4;
		__builtin_memcpy(f->saddr, &ip.saddr, 4);
		__builtin_memcpy(f->daddr, &ip.daddr, 4);
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;

		if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0)
			return -1;
		f->family = FAMILY_IPV6;
		f->proto = ip6.nexthdr;
		f->l4 = ETH_HLEN + sizeof(ip6);
		__builtin_memcpy(f->saddr, &ip6.saddr, 16);
		__builtin_memcpy(f->daddr, &ip6.daddr, 16);
	} else {
		return -1;
	}
	if (f->proto != IPPROTO_TCP && f->proto != IPPROTO_UDP)
		return -1;
	if (bpf_skb_load_bytes(skb, f->l4, ports, sizeof(ports)) < 0)
		return -1;
	f->sport = ports[0];
	f->dport = ports[1];
	return 0;
}

static __always_inline __u32 l4_csum_off(const struct flow *f)
{
	return f->l4 + (f->proto == IPPROTO_TCP ? 16 : 6);
}

static __always_inline __u64 l4_csum_flags(const struct flow *f)
{
	/* A UDP/IPv4 checksum of 0 means none: keep it so. */
	return f->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* set_addr rewrites the source (dst 0) or destination address of the frame
 * and f, with the checksums. */
static __always_inline int set_addr(struct __sk_buff *skb, struct flow *f, int dst, const __u8 *to)
{
	__u8 from[16];
	__s64 diff;
	__u32 off;

	__builtin_memcpy(from, dst ? f->daddr : f->saddr, 16);
	if (f->family == FAMILY_IPV4) {
		diff = bpf_csum_diff((__be32 *)from, 4, (__be32 *)to, 4, 0);
		off = ETH_HLEN + (dst ? 16 : 12);
	} else {
		diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);
		off = ETH_HLEN + (dst ? 24 : 8);
	}
	if (diff < 0)
		return -1;
	if (bpf_l4_csum_replace(skb, l4_csum_off(f), 0, diff, BPF_F_PSEUDO_HDR | l4_csum_flags(f)) < 0)
		return -1;
	if (f->family == FAMILY_IPV4) {
		if (bpf_l3_csum_replace(skb, ETH_HLEN + 10, 0, diff, 0) < 0)
			return -1;
		if (bpf_skb_store_bytes(skb, off, to, 4, 0) < 0)
			return -1;
	} else if (bpf_skb_store_bytes(skb, off, to, 16, 0) < 0) {
		return -1;
	}
	__builtin_memcpy(dst ? f->daddr : f->saddr, to, 16);
	return 0;
}

/* set_port rewrites the source (dst 0) or destination port. */
static __always_inline int set_port(struct __sk_buff *skb, struct flow *f, int dst, __be16 to)
{
	__be16 from = dst ? f->dport : f->sport;

	if (from == to)
		return 0;
	if (bpf_l4_csum_replace(skb, l4_csum_off(f), from, to, sizeof(to) | l4_csum_flags(f)) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, f->l4 + (dst ? 2 : 0), &to, sizeof(to), 0) < 0)
		return -1;
	if (dst)
		f->dport = to;
	else
		f->sport = to;
	return 0;
}

static __always_inline int same_addr(const __u8 *a, const __u8 *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;

	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

/* fib looks f up in the node's FIB as for a frame arriving on the
 * interface the program runs on. */
static __always_inline int fib(struct __sk_buff *skb, const struct flow *f, struct bpf_fib_lookup *p)
{
	__builtin_memset(p, 0, sizeof(*p));
	p->ifindex = skb->ifindex;
	p->l4_protocol = f->proto;
	p->sport = f->sport;
	p->dport = f->dport;
	if (f->family == FAMILY_IPV4) {
		p->family = 2; /* AF_INET */
		__builtin_memcpy(&p->ipv4_src, f->saddr, 4);
		__builtin_memcpy(&p->ipv4_dst, f->daddr, 4);
	} else {
		p->family = 10; /* AF_INET6 */
		__builtin_memcpy(p->ipv6_src, f->saddr, 16);
		__builtin_memcpy(p->ipv6_dst, f->daddr, 16);
	}
	return bpf_fib_lookup(skb, p, sizeof(*p), 0);
}

/* local_dst reports whether the kernel would deliver f to the node itself. */
static __always_inline int local_dst(struct __sk_buff *skb, const struct flow *f)
{
	struct bpf_fib_lookup p;

	return fib(skb, f, &p) == BPF_FIB_LKUP_RET_NOT_FWDED;
}

/* forward sends a translated frame on its way: straight out of the
 * interface the FIB names (bpf_redirect_neigh fills in the Ethernet
 * header), so that the node's netfilter sees neither direction of a
 * translated flow (its conntrack would find a reply to a flow it never
 * saw INVALID, which kube-proxy drops); to the node itself, or anything
 * the FIB does not forward, through the kernel's stack. */
static __always_inline int forward(struct __sk_buff *skb, const struct flow *f)
{
	struct bpf_fib_lookup p;
	int rc = fib(skb, f, &p);

	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
		return TC_ACT_UNSPEC;
	return bpf_redirect_neigh(p.ifindex, 0, 0, 0);
}

static __always_inline int loopback_dst(const struct flow *f)
{
	const __u32 *w = (const __u32 *)f->daddr;

	if (f->family == FAMILY_IPV4)
		return f->daddr[0] == 127;
	return w[0] == 0 && w[1] == 0 && w[2] == 0 && w[3] == bpf_htonl(1);
}

/* hostport_find is the mapping f's destination names, if the destination
 * is the node's (on lo, always, but for loopback addresses). */
static __always_inline struct hostport_info *hostport_find(struct __sk_buff *skb, const struct flow *f, int on_lo)
{
	struct hostport_key k = {.family = f->family, .proto = f->proto, .port = f->dport};
	struct hostport_info *hp;

	__builtin_memcpy(k.addr, f->daddr, 16);
	hp = bpf_map_lookup_elem(&kvipam_hostports, &k);
	if (!hp) {
		__builtin_memset(k.addr, 0, 16);
		hp = bpf_map_lookup_elem(&kvipam_hostports, &k);
	}
	if (!hp)
		return 0;
	if (on_lo)
		return loopback_dst(f) ? 0 : hp;
	return local_dst(skb, f) ? hp : 0;
}

/* hostport_dnat translates f to the pod of hp and records the flow. */
static __always_inline int hostport_dnat(struct __sk_buff *skb, struct flow *f, const struct hostport_info *hp)
{
	struct nat_key k = {.family = f->family, .proto = f->proto, .pod_port = hp->port, .peer_port = f->sport};
	struct nat_info v = {.host_port = f->dport, .client_port = f->sport, .ifindex = hp->ifindex};
	__u8 pod[16];

	__builtin_memcpy(pod, hp->addr, 16);
	__builtin_memcpy(k.pod_addr, pod, 16);
	__builtin_memcpy(v.host_addr, f->daddr, 16);
	__builtin_memcpy(v.client_addr, f->saddr, 16);
	if (same_addr(f->saddr, pod)) {
		/* The pod reaches its own host port: it sees the address it
		 * dialed as the peer. */
		__builtin_memcpy(k.peer_addr, v.host_addr, 16);
		if (set_addr(skb, f, 0, v.host_addr) < 0)
			return -1;
	} else {
		__builtin_memcpy(k.peer_addr, v.client_addr, 16);
	}
	if (bpf_map_update_elem(&kvipam_nat, &k, &v, BPF_ANY) < 0)
		return -1;
	if (set_addr(skb, f, 1, pod) < 0 || set_port(skb, f, 1, k.pod_port) < 0)
		return -1;
	return 0;
}

/* hostport_reply translates a pod's reply in a recorded flow back; 1 if it
 * did, 0 if f is no such reply, -1 on failure. */
static __always_inline int hostport_reply(struct __sk_buff *skb, struct flow *f)
{
	struct nat_key k = {.family = f->family, .proto = f->proto, .pod_port = f->sport, .peer_port = f->dport};
	struct nat_info *v;
	struct nat_info to;

	__builtin_memcpy(k.pod_addr, f->saddr, 16);
	__builtin_memcpy(k.peer_addr, f->daddr, 16);
	v = bpf_map_lookup_elem(&kvipam_nat, &k);
	if (!v)
		return 0;
	__builtin_memcpy(&to, v, sizeof(to));
	if (set_addr(skb, f, 0, to.host_addr) < 0 || set_port(skb, f, 0, to.host_port) < 0 ||
	    set_addr(skb, f, 1, to.client_addr) < 0 || set_port(skb, f, 1, to.client_port) < 0)
		return -1;
	return 1;
}

/* hostport_pod runs on a frame from a pod that the source check let pass:
 * a reply in a translated flow is translated back, a frame to a host port
 * of the node is translated to its pod (hairpin). */
static __always_inline int hostport_pod(struct __sk_buff *skb, int verdict)
{
	struct flow f = {};
	struct hostport_info *hp;
	int rc;

	if (verdict != TC_ACT_UNSPEC || parse(skb, &f) < 0)
		return verdict;
	rc = hostport_reply(skb, &f);
	if (rc)
		return rc < 0 ? TC_ACT_SHOT : forward(skb, &f);
	hp = hostport_find(skb, &f, 0);
	if (!hp)
		return verdict;
	if (hostport_dnat(skb, &f, hp) < 0)
		return TC_ACT_SHOT;
	return forward(skb, &f);
}

/* kvipam_hostport_in runs on the ingress of the node's uplinks: other
 * hosts' frames to a host port go to its pod. */
SEC("tc")
int kvipam_hostport_in(struct __sk_buff *skb)
{
	struct flow f = {};
	struct hostport_info *hp;

	if (parse(skb, &f) < 0)
		return TC_ACT_UNSPEC;
	hp = hostport_find(skb, &f, 0);
	if (!hp)
		return TC_ACT_UNSPEC;
	if (hostport_dnat(skb, &f, hp) < 0)
		return TC_ACT_SHOT;
	return forward(skb, &f);
}

/* kvipam_hostport_local runs on the egress of lo: the node's own
 * connections to one of its addresses and a host port. The kernel has
 * routed such a frame to the node itself, so after the translation it is
 * sent out of the pod's host veth directly. */
SEC("tc")
int kvipam_hostport_local(struct __sk_buff *skb)
{
	struct flow f = {};
	struct hostport_info *hp;
	__u8 macs[12];
	__u32 ifindex;

	if (parse(skb, &f) < 0)
		return TC_ACT_UNSPEC;
	hp = hostport_find(skb, &f, 1);
	if (!hp)
		return TC_ACT_UNSPEC;
	ifindex = hp->ifindex;
	__builtin_memcpy(macs, hp->pod_mac, 6);
	__builtin_memcpy(macs + 6, hp->host_mac, 6);
	if (hostport_dnat(skb, &f, hp) < 0 || bpf_skb_store_bytes(skb, 0, macs, sizeof(macs), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(ifindex, 0);
}
