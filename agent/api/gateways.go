package api

import "net/netip"

// GatewayV4 and GatewayV6 are the pods' link-local next hops, the same for
// every pod on every node. The host veth answers ARP for the IPv4 one
// (proxy ARP), and has the IPv6 one as its link-local address: the EUI-64
// address of its fixed MAC ee:ee:ee:ee:ee:ee. The agent names them with
// each allocated address (IPConfig.Gateway) and in Config; the plugins
// fall back to them when an answer names none.
var (
	GatewayV4 = netip.MustParseAddr("169.254.1.1")
	GatewayV6 = netip.MustParseAddr("fe80::ecee:eeff:feee:eeee")
)
