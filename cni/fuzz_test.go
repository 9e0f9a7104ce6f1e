package cni

import (
	"bytes"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
)

// FuzzParseConfig: no configuration may crash either parser, and every
// refusal carries one of the codes the parsers document.
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		`{"cniVersion":"1.0.0","name":"pods","type":"kvipam"}`,
		`{"cniVersion":"1.1.0","name":"pods","type":"kvipam","agentSocket":"/run/k.sock","pool":"p","families":["ipv4","ipv6"],"mtu":1400,"agentTimeout":"3s","dns":{"nameservers":["10.0.0.10"]},"runtimeConfig":{"ips":["10.1.0.9/24"]}}`,
		`{"cniVersion":"0.4.0","name":"n","prevResult":{"interfaces":[{"name":"eth0","sandbox":"/x"}],"ips":[{"version":"4","address":"10.1.0.5/32","interface":0}],"routes":[{"dst":"0.0.0.0/0"}]}}`,
		`{"cniVersion":"0.3.1","name":"n","prevResult":{"ips":[{"version":"6","address":"fd00::1/128","interface":-1}]}}`,
		`{"cniVersion":"1.1.0","name":"n","cni.dev/valid-attachments":[{"containerID":"c","ifname":"eth0"}],"cni.dev/attachments":null}`,
		`{"cniVersion":"1.0.0","name":"br","ipam":{"type":"kvipam-ipam","gatewayV4":"10.0.0.1","routes":[{"dst":"10.0.0.0/8","gw":"10.0.0.1"}]}}`,
		`{"cniVersion":"1.0.0","name":"n","prevResult":{"interfaces":[null],"ips":[{}],"routes":[{"dst":"x"}]}}`,
		`{"cniVersion":"1.0.0","name":"n","pol":"x","ipam":{"type":"kvipam-ipam","pol":"y","cni.dev/z":1}}`,
		`{"cniVersion":"1.0.0","name":"n","ipam":null}`,
		`[]`, `null`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		for name, parse := range map[string]func([]byte) (*Config, error){"plugin": ParseConfig, "ipam": ParseIPAMConfig} {
			c, err := parse(data)
			if err != nil {
				switch Code(err) {
				case types.ErrDecodingFailure, types.ErrIncompatibleCNIVersion, types.ErrInvalidNetworkConfig:
				default:
					t.Fatalf("%s: error with code %d: %v", name, Code(err), err)
				}
				continue
			}
			if c.Name == "" || c.Socket == "" || c.AgentTimeout <= 0 || c.DelQueueDir == "" {
				t.Fatalf("%s: accepted config lacks a default: %+v", name, c)
			}
			if c.PrevResult != nil {
				// What CHECK does with it must not crash either.
				var buf bytes.Buffer
				_ = PrintResult(&buf, c.PrevResult, c.CNIVersion)
			}
		}
	})
}

// FuzzParseArgs: no CNI_ARGS may crash the parser; what it accepts is
// bounded and printable.
func FuzzParseArgs(f *testing.F) {
	for _, s := range []string{
		"", "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1",
		"K8S_POD_NAME", "=;=", "CommonArgs=x", "IgnoreUnknown=1;IgnoreUnknown=0;X=y", "k8s_pod_name=x", "K8S_POD_NAME=\x00",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		a, err := ParseArgs(s)
		if err != nil {
			if Code(err) != types.ErrInvalidEnvironmentVariables || !strings.Contains(err.Error(), "CNI_ARGS") {
				t.Fatalf("error with code %d: %v", Code(err), err)
			}
			return
		}
		for _, v := range []string{a.PodNamespace, a.PodName, a.PodInfraContainerID, a.PodUID} {
			if len(v) > maxArgLen || strings.ContainsAny(v, "\x00\n;") {
				t.Fatalf("accepted %q", v)
			}
		}
	})
}
