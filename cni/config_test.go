package cni

import (
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
)

func TestParseConfig(t *testing.T) {
	tests := []struct {
		name     string
		conf     string
		wantCode uint
		wantErr  string
		check    func(t *testing.T, c *Config)
	}{
		{
			name: "defaults",
			conf: `{"cniVersion":"1.0.0","name":"pods","type":"kvipam"}`,
			check: func(t *testing.T, c *Config) {
				require.Equal(t, DefaultAgentSocket, c.Socket)
				require.Equal(t, DefaultAgentTimeout, c.AgentTimeout)
				require.Equal(t, DefaultDelQueueDir, c.DelQueueDir)
				require.Empty(t, c.Pool)
				require.Nil(t, c.ValidAttachments)
				require.Nil(t, c.PrevResult)
			},
		},
		{
			name: "everything",
			conf: `{"cniVersion":"1.1.0","name":"pods","type":"kvipam","agentSocket":"/tmp/a.sock","pool":"blue-1",
				"families":["v4","IPv6"],"mtu":1400,"agentTimeout":"3s","delQueueDir":"/tmp/q","logLevel":"DEBUG","logFile":"/tmp/l",
				"dns":{"nameservers":["10.96.0.10"],"search":["svc.cluster.local"]},
				"capabilities":{"ips":true},"runtimeConfig":{"ips":["10.1.0.9/24","fd00::9"]}}`,
			check: func(t *testing.T, c *Config) {
				require.Equal(t, "/tmp/a.sock", c.Socket)
				require.Equal(t, "blue-1", c.Pool)
				require.Equal(t, []string{"ipv4", "ipv6"}, c.Families)
				require.Equal(t, 1400, c.MTU)
				require.Equal(t, 3*time.Second, c.AgentTimeout)
				require.Equal(t, "/tmp/q", c.DelQueueDir)
				require.Equal(t, "debug", c.LogLevel)
				require.Equal(t, []string{"10.96.0.10"}, c.DNS.Nameservers)
				require.Equal(t, []netip.Addr{netip.MustParseAddr("10.1.0.9"), netip.MustParseAddr("fd00::9")}, c.IPs)
			},
		},
		{
			name: "bandwidth capability: egress limited or not",
			conf: `{"cniVersion":"1.0.0","name":"pods","type":"kvipam","runtimeConfig":{"bandwidth":{"ingressRate":1000,"egressRate":2000,"egressBurst":400}}}`,
			check: func(t *testing.T, c *Config) {
				require.True(t, c.EgressLimited)
				c2, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"pods","type":"kvipam","runtimeConfig":{"bandwidth":{"ingressRate":1000,"ingressBurst":10}}}`))
				require.NoError(t, err)
				require.False(t, c2.EgressLimited, "an ingress limit adds no ingress qdisc")
			},
		},
		{
			name: "gc list, either spelling",
			conf: `{"cniVersion":"1.1.0","name":"pods","type":"kvipam","cni.dev/attachments":[{"containerID":"c1","ifname":"eth0"}]}`,
			check: func(t *testing.T, c *Config) {
				require.Len(t, c.ValidAttachments, 1)
				require.Equal(t, "c1", c.ValidAttachments[0].ContainerID)
				require.Equal(t, "eth0", c.ValidAttachments[0].IfName)
			},
		},
		{
			name: "an empty gc list is not an absent one",
			conf: `{"cniVersion":"1.1.0","name":"pods","type":"kvipam","cni.dev/valid-attachments":[]}`,
			check: func(t *testing.T, c *Config) {
				require.NotNil(t, c.ValidAttachments)
				require.Empty(t, c.ValidAttachments)
			},
		},
		{
			name: "prevResult in an old version",
			conf: `{"cniVersion":"0.3.1","name":"pods","type":"kvipam","prevResult":{"cniVersion":"0.3.1",
				"interfaces":[{"name":"kvabc"},{"name":"eth0","sandbox":"/run/netns/x"}],
				"ips":[{"version":"4","address":"10.1.0.5/32","gateway":"169.254.1.1","interface":1}],
				"routes":[{"dst":"0.0.0.0/0","gw":"169.254.1.1"}]}}`,
			check: func(t *testing.T, c *Config) {
				require.NotNil(t, c.PrevResult)
				require.Len(t, c.PrevResult.IPs, 1)
				require.Equal(t, "10.1.0.5/32", c.PrevResult.IPs[0].Address.String())
				require.Equal(t, 1, *c.PrevResult.IPs[0].Interface)
			},
		},
		{name: "not json", conf: `{"cniVersion":`, wantCode: types.ErrDecodingFailure, wantErr: "decode network configuration"},
		{name: "wrong type", conf: `{"cniVersion":"1.0.0","name":"n","mtu":"1500"}`, wantCode: types.ErrDecodingFailure},
		{name: "old version", conf: `{"cniVersion":"0.2.0","name":"n"}`, wantCode: types.ErrIncompatibleCNIVersion, wantErr: `cniVersion "0.2.0" is not supported`},
		{name: "no version", conf: `{"name":"n"}`, wantCode: types.ErrIncompatibleCNIVersion},
		{name: "no name", conf: `{"cniVersion":"1.0.0"}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "name is empty"},
		{name: "relative socket", conf: `{"cniVersion":"1.0.0","name":"n","agentSocket":"agent.sock"}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "agentSocket"},
		{name: "bad pool", conf: `{"cniVersion":"1.0.0","name":"n","pool":"Blue"}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: `pool "Blue"`},
		{name: "bad family", conf: `{"cniVersion":"1.0.0","name":"n","families":["ipv5"]}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "families[0]"},
		{name: "family twice", conf: `{"cniVersion":"1.0.0","name":"n","families":["4","ipv4"]}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "twice"},
		{name: "bad timeout", conf: `{"cniVersion":"1.0.0","name":"n","agentTimeout":"10"}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "agentTimeout"},
		{name: "huge timeout", conf: `{"cniVersion":"1.0.0","name":"n","agentTimeout":"1h"}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "agentTimeout"},
		{name: "bad mtu", conf: `{"cniVersion":"1.0.0","name":"n","mtu":70000}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "mtu"},
		{name: "relative queue", conf: `{"cniVersion":"1.0.0","name":"n","delQueueDir":"q"}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "delQueueDir"},
		{name: "bad log level", conf: `{"cniVersion":"1.0.0","name":"n","logLevel":"loud"}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "logLevel"},
		{name: "bad static ip", conf: `{"cniVersion":"1.0.0","name":"n","runtimeConfig":{"ips":["10.1.0.300"]}}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "runtimeConfig.ips[0]"},
		{name: "two static ipv4", conf: `{"cniVersion":"1.0.0","name":"n","runtimeConfig":{"ips":["10.1.0.3","10.1.0.4"]}}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "more than one IPv4"},
		{name: "null in prevResult", conf: `{"cniVersion":"0.4.0","name":"n","prevResult":{"ips":[null]}}`, wantCode: types.ErrDecodingFailure, wantErr: "ips[0] is null"},
		{name: "prevResult interface out of range", conf: `{"cniVersion":"1.0.0","name":"n","prevResult":{"ips":[{"address":"10.1.0.5/32","interface":3}]}}`, wantCode: types.ErrDecodingFailure, wantErr: "interface 3"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig([]byte(tt.conf))
			if tt.wantCode != 0 {
				require.Error(t, err)
				require.Equal(t, tt.wantCode, Code(err), "error: %v", err)
				require.Contains(t, err.Error(), tt.wantErr)
				return
			}
			require.NoError(t, err)
			tt.check(t, c)
		})
	}
}

// TestDelConfigSkipsPrevResult: DEL does not read the prevResult, so one
// that ADD or CHECK would refuse does not stop a teardown.
func TestDelConfigSkipsPrevResult(t *testing.T) {
	for _, prev := range []string{
		`{"ips":[null]}`,
		`{"ips":[{"address":"10.1.0.5/32","interface":3}]}`,
		`{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.5/32"}]}`,
	} {
		conf := []byte(`{"cniVersion":"1.0.0","name":"n","prevResult":` + prev + `}`)
		c, err := ParseDelConfig(conf)
		require.NoError(t, err, prev)
		require.Nil(t, c.PrevResult)
		ipam := []byte(`{"cniVersion":"1.0.0","name":"n","ipam":{"type":"kvipam-ipam"},"prevResult":` + prev + `}`)
		c, err = ParseIPAMDelConfig(ipam)
		require.NoError(t, err, prev)
		require.Nil(t, c.PrevResult)
	}
	c, err := ParseConfig([]byte(`{"cniVersion":"1.0.0","name":"n","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.1.0.5/32"}]}}`))
	require.NoError(t, err)
	require.NotNil(t, c.PrevResult, "ADD and CHECK still read it")
}

func TestParseIPAMConfig(t *testing.T) {
	tests := []struct {
		name     string
		conf     string
		wantCode uint
		wantErr  string
		check    func(t *testing.T, c *Config)
	}{
		{
			name: "bridge with kvipam-ipam",
			conf: `{"cniVersion":"1.1.0","name":"br","type":"bridge","bridge":"cni0","isGateway":true,
				"ipam":{"type":"kvipam-ipam","pool":"bridge","agentSocket":"/run/k.sock","gatewayV4":"10.22.0.1",
				"routes":[{"dst":"0.0.0.0/0"}]},"runtimeConfig":{"ips":["10.22.0.7/16"]}}`,
			check: func(t *testing.T, c *Config) {
				require.Equal(t, "bridge", c.Pool)
				require.Equal(t, "/run/k.sock", c.Socket)
				require.Equal(t, netip.MustParseAddr("10.22.0.1"), c.GatewayV4)
				require.False(t, c.GatewayV6.IsValid())
				require.Len(t, c.Routes, 1)
				require.Equal(t, []netip.Addr{netip.MustParseAddr("10.22.0.7")}, c.IPs)
				require.Equal(t, AddressPrefixBlock, c.AddressPrefix)
			},
		},
		{
			name: "top-level kvipam keys are not read",
			conf: `{"cniVersion":"1.0.0","name":"br","pool":"other","ipam":{"type":"kvipam-ipam"}}`,
			check: func(t *testing.T, c *Config) {
				require.Empty(t, c.Pool)
				require.Nil(t, c.Routes)
			},
		},
		{name: "bad prefix length", conf: `{"cniVersion":"1.0.0","name":"br","ipam":{"prefixLengthV4":33}}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "ipam.prefixLengthV4"},
		{name: "bad addressPrefix", conf: `{"cniVersion":"1.0.0","name":"br","ipam":{"addressPrefix":"subnet"}}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "ipam.addressPrefix"},
		{name: "gateway of the wrong family", conf: `{"cniVersion":"1.0.0","name":"br","ipam":{"gatewayV4":"fd00::1"}}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "ipam.gatewayV4"},
		{name: "route without dst", conf: `{"cniVersion":"1.0.0","name":"br","ipam":{"routes":[{"gw":"10.0.0.1"}]}}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "ipam.routes[0]"},
		{name: "errors name the ipam key", conf: `{"cniVersion":"1.0.0","name":"br","ipam":{"pool":"-x"}}`, wantCode: types.ErrInvalidNetworkConfig, wantErr: "ipam.pool"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseIPAMConfig([]byte(tt.conf))
			if tt.wantCode != 0 {
				require.Error(t, err)
				require.Equal(t, tt.wantCode, Code(err), "error: %v", err)
				require.Contains(t, err.Error(), tt.wantErr)
				return
			}
			require.NoError(t, err)
			tt.check(t, c)
		})
	}
}

func TestParseArgs(t *testing.T) {
	tests := []struct {
		name    string
		args    string
		want    Args
		wantErr string
	}{
		{name: "none (ctr, cnitool)", args: ""},
		{
			name: "kubelet",
			args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1234-5678",
			want: Args{PodNamespace: "default", PodName: "web-0", PodInfraContainerID: "abc", PodUID: "1234-5678"},
		},
		{name: "unknown ignored", args: "IgnoreUnknown=true;FOO=bar;K8S_POD_NAME=p", want: Args{PodName: "p"}},
		{name: "unknown refused", args: "FOO=bar", wantErr: "unknown args"},
		{name: "not a pair", args: "K8S_POD_NAME", wantErr: "invalid pair"},
		{name: "value with =", args: "K8S_POD_NAME=a=b", wantErr: "invalid pair"},
		{name: "bad bool", args: "IgnoreUnknown=maybe", wantErr: "IgnoreUnknown"},
		{name: "control character", args: "K8S_POD_NAME=a\nb", wantErr: "control"},
		{name: "too long", args: "K8S_POD_NAME=" + string(make([]byte, 300)), wantErr: "at most 253"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseArgs(tt.args)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.Equal(t, types.ErrInvalidEnvironmentVariables, Code(err))
				require.Contains(t, err.Error(), "CNI_ARGS")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}

func TestHostVethName(t *testing.T) {
	a := HostVethName("c1", "eth0")
	require.Len(t, a, 13)
	require.Regexp(t, `^kv[0-9a-f]{11}$`, a)
	require.Equal(t, a, HostVethName("c1", "eth0"), "stable, so DEL finds it without state")
	require.NotEqual(t, a, HostVethName("c1", "eth1"))
	require.NotEqual(t, a, HostVethName("c2", "eth0"))
}

// TestPodAnnotations: the pod's kvipam.io/pool and kvipam.io/ips, passed
// by the runtime through the io.kubernetes.cri.pod-annotations capability,
// become the request's pod pool and static addresses; bad ones are code 7
// naming the annotation.
func TestPodAnnotations(t *testing.T) {
	conf := func(ann, ips string) string {
		rc := `"io.kubernetes.cri.pod-annotations":` + ann
		if ips != "" {
			rc += `,"ips":` + ips
		}
		return `{"cniVersion":"1.0.0","name":"kv","type":"kvipam","pool":"default","runtimeConfig":{` + rc + `}}`
	}
	c, err := ParseConfig([]byte(conf(`{"kvipam.io/pool":"blue","kvipam.io/ips":"10.62.0.9, fd00:62::9","other":"x"}`, "")))
	require.NoError(t, err)
	require.Equal(t, "blue", c.PodPool)
	require.Equal(t, "default", c.Pool, "the configuration's pool stays, behind the pod's")
	require.Equal(t, []netip.Addr{netip.MustParseAddr("10.62.0.9"), netip.MustParseAddr("fd00:62::9")}, c.IPs)

	c, err = ParseConfig([]byte(conf(`{"kvipam.io/ips":"10.62.0.9"}`, `["10.62.0.9/24"]`)))
	require.NoError(t, err, "the same address from both")
	require.Empty(t, c.PodPool)

	c, err = ParseConfig([]byte(conf(`{"kvipam.io/sticky":"10m","kvipam.io/ip-claim":"pg-primary"}`, "")))
	require.NoError(t, err)
	require.Equal(t, 10*time.Minute, c.Sticky)
	require.Equal(t, "pg-primary", c.IPClaim)

	for ann, want := range map[string]string{
		`{"kvipam.io/sticky":"forever"}`:                       `pod annotation kvipam.io/sticky "forever" is not a duration`,
		`{"kvipam.io/ip-claim":"x"}`:                           "needs kvipam.io/sticky",
		`{"kvipam.io/sticky":"1m","kvipam.io/ip-claim":"a/b"}`: `kvipam.io/ip-claim "a/b" is not a name`,
		`{"kvipam.io/pool":""}`:                                `pod annotation kvipam.io/pool "" is not a pool name`,
		`{"kvipam.io/ips":"10.62.0.x"}`:                        `pod annotation kvipam.io/ips[0] "10.62.0.x" is not an IP address`,
		`{"kvipam.io/ips":"10.1.1.1,10.1.1.2"}`:                "more than one IPv4",
	} {
		_, err := ParseConfig([]byte(conf(ann, "")))
		require.ErrorContains(t, err, want)
		require.Equal(t, uint(7), Code(err))
	}
	_, err = ParseConfig([]byte(conf(`{"kvipam.io/ips":"10.62.0.9"}`, `["10.62.0.8"]`)))
	require.ErrorContains(t, err, "disagree")
}
