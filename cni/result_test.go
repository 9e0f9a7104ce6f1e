package cni

import (
	"bytes"
	"encoding/json"
	"net"
	"net/netip"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
)

func dualStackSpec() (PodSpec, *PodLinks) {
	s := PodSpec{
		Netns: "/run/netns/p1", IfName: "eth0", HostIfName: "kv0123456789a", MTU: 1500,
		Addrs:     []netip.Prefix{netip.MustParsePrefix("10.1.0.5/32"), netip.MustParsePrefix("fd00::5/128")},
		GatewayV4: api.GatewayV4, GatewayV6: api.GatewayV6,
	}
	l := &PodLinks{HostIfName: s.HostIfName, HostMAC: HostVethMAC, PodIfName: "eth0", PodMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}}
	return s, l
}

// Every supported version prints a result that libcni's parser for that
// version reads back with the same addresses, as a runtime would.
func TestPodResultInEveryVersion(t *testing.T) {
	s, l := dualStackSpec()
	dns := types.DNS{Nameservers: []string{"10.96.0.10"}}
	for _, v := range SupportedVersions {
		t.Run(v, func(t *testing.T) {
			var buf bytes.Buffer
			require.NoError(t, PrintResult(&buf, podResult(s, l, dns), v))
			var raw map[string]any
			require.NoError(t, json.Unmarshal(buf.Bytes(), &raw))
			require.Equal(t, v, raw["cniVersion"], "answer in the configuration's version")

			parsed, err := version.NewResult(v, buf.Bytes())
			require.NoError(t, err)
			cur, err := current.NewResultFromResult(parsed)
			require.NoError(t, err)
			require.Len(t, cur.Interfaces, 2)
			require.Equal(t, "kv0123456789a", cur.Interfaces[0].Name)
			require.Equal(t, "ee:ee:ee:ee:ee:ee", cur.Interfaces[0].Mac)
			require.Equal(t, "/run/netns/p1", cur.Interfaces[1].Sandbox)
			require.Len(t, cur.IPs, 2)
			require.Equal(t, "10.1.0.5/32", cur.IPs[0].Address.String())
			require.Equal(t, "169.254.1.1", cur.IPs[0].Gateway.String())
			require.Equal(t, 1, *cur.IPs[0].Interface)
			require.Equal(t, "fd00::5/128", cur.IPs[1].Address.String())
			require.Equal(t, "fe80::ecee:eeff:feee:eeee", cur.IPs[1].Gateway.String())
			var dsts []string
			for _, r := range cur.Routes {
				dsts = append(dsts, r.Dst.String()+" via "+r.GW.String())
			}
			require.Equal(t, []string{"169.254.1.1/32 via <nil>", "0.0.0.0/0 via 169.254.1.1", "::/0 via fe80::ecee:eeff:feee:eeee"}, dsts)
			require.Equal(t, []string{"10.96.0.10"}, cur.DNS.Nameservers)
			if v == "0.3.0" || v == "0.3.1" {
				require.Contains(t, buf.String(), `"version": "4"`, "0.3.x results carry the IP version")
			}
		})
	}
}

func TestIPAMResult(t *testing.T) {
	als := []Allocated{{Addr: netip.MustParsePrefix("10.22.0.7/32"), Gateway: api.GatewayV4, Block: netip.MustParsePrefix("10.22.0.0/26")}}
	routes := func(r *current.Result) []string {
		var out []string
		for _, rt := range r.Routes {
			out = append(out, routeString(rt))
		}
		return out
	}
	t.Run("link-local gateway", func(t *testing.T) {
		r := ipamResult(als, &Config{AddressPrefix: AddressPrefixBlock}, api.GatewayV4, api.GatewayV6)
		require.Nil(t, r.Interfaces)
		require.Len(t, r.IPs, 1)
		require.Nil(t, r.IPs[0].Interface, "the main plugin assigns the interface")
		require.Equal(t, "10.22.0.7/26", r.IPs[0].Address.String(), "the block's prefix")
		require.Nil(t, r.IPs[0].Gateway, "else ipam.ConfigureIface routes the link route through it")
		require.Equal(t, []string{"169.254.1.1/32 scope link", "0.0.0.0/0 via 169.254.1.1"}, routes(r))
	})
	t.Run("configured gateway", func(t *testing.T) {
		gw := netip.MustParseAddr("10.22.0.1")
		r := ipamResult(als, &Config{AddressPrefix: AddressPrefixHost, GatewayV4: gw}, api.GatewayV4, api.GatewayV6)
		require.Equal(t, "10.22.0.1", r.IPs[0].Gateway.String())
		require.Equal(t, "10.22.0.7/32", r.IPs[0].Address.String(), "addressPrefix host")
		require.Equal(t, []string{"0.0.0.0/0 via 10.22.0.1"}, routes(r))
	})
	t.Run("configured routes", func(t *testing.T) {
		_, dst, _ := net.ParseCIDR("10.0.0.0/8")
		want := []*types.Route{{Dst: *dst}}
		r := ipamResult(als, &Config{Routes: want}, api.GatewayV4, api.GatewayV6)
		require.Equal(t, want, r.Routes)
	})
	t.Run("a LAN's prefix length", func(t *testing.T) {
		r := ipamResult(als, &Config{AddressPrefix: AddressPrefixBlock, PrefixLengthV4: 16}, api.GatewayV4, api.GatewayV6)
		require.Equal(t, "10.22.0.7/16", r.IPs[0].Address.String())
	})
}

func TestParseAllocation(t *testing.T) {
	tests := []struct {
		name    string
		in      *api.AllocateResponse
		want    []Allocated
		wantErr string
	}{
		{name: "nil", in: nil, wantErr: "no address"},
		{name: "empty", in: &api.AllocateResponse{}, wantErr: "no address"},
		{
			name: "dual stack",
			in: &api.AllocateResponse{IPs: []api.IPConfig{
				{Address: netip.MustParsePrefix("10.1.0.5/32"), Gateway: api.GatewayV4, Block: netip.MustParsePrefix("10.1.0.0/26")},
				{Address: netip.MustParsePrefix("fd00::5/128"), Block: netip.MustParsePrefix("fd00:9::/120")},
			}},
			want: []Allocated{
				{Addr: netip.MustParsePrefix("10.1.0.5/32"), Gateway: netip.MustParseAddr("169.254.1.1"), Block: netip.MustParsePrefix("10.1.0.0/26")},
				{Addr: netip.MustParsePrefix("fd00::5/128")},
			},
		},
		{name: "block prefix becomes a host prefix", in: &api.AllocateResponse{IPs: []api.IPConfig{{Address: netip.MustParsePrefix("10.1.0.5/26")}}},
			want: []Allocated{{Addr: netip.MustParsePrefix("10.1.0.5/32")}}},
		{name: "no address", in: &api.AllocateResponse{IPs: []api.IPConfig{{Family: "ipv4"}}}, wantErr: "invalid address"},
		{name: "gateway of the other family", in: &api.AllocateResponse{IPs: []api.IPConfig{{Address: netip.MustParsePrefix("10.1.0.5/32"), Gateway: netip.MustParseAddr("fe80::1")}}}, wantErr: "gateway"},
		{name: "block not holding the address", in: &api.AllocateResponse{IPs: []api.IPConfig{{Address: netip.MustParsePrefix("10.1.0.5/32"), Block: netip.MustParsePrefix("10.2.0.0/26")}}},
			want: []Allocated{{Addr: netip.MustParsePrefix("10.1.0.5/32")}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseAllocation(tt.in)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}

func TestGatewaysPrecedence(t *testing.T) {
	a4 := netip.MustParseAddr("169.254.9.9")
	conf4 := netip.MustParseAddr("10.0.0.1")
	als := []Allocated{{Addr: netip.MustParsePrefix("10.1.0.5/32"), Gateway: a4}}

	gw4, gw6 := gateways(als, conf4, netip.Addr{})
	require.Equal(t, conf4, gw4, "configuration first")
	require.Equal(t, api.GatewayV6, gw6, "kvipam's constant for a family the allocation has no gateway of")
	gw4, _ = gateways(als, netip.Addr{}, netip.Addr{})
	require.Equal(t, a4, gw4, "then the allocation's")
	gw4, gw6 = gateways(nil, netip.Addr{}, netip.Addr{})
	require.Equal(t, api.GatewayV4, gw4, "then kvipam's constants")
	require.Equal(t, api.GatewayV6, gw6)
}
