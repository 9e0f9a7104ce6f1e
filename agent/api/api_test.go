package api_test

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
)

var (
	owner   = api.Owner{ContainerID: "c1", IfName: "eth0", Namespace: "ns", Pod: "web-0", PodUID: "u1", Network: "pods"}
	addr4   = netip.MustParseAddr("10.0.0.5")
	addr6   = netip.MustParseAddr("fd00::5")
	host4   = netip.MustParsePrefix("10.0.0.5/32")
	host6   = netip.MustParsePrefix("fd00::5/128")
	block4  = netip.MustParsePrefix("10.0.0.0/26")
	block6  = netip.MustParsePrefix("fd00::/120")
	expires = time.Date(2026, 11, 22, 8, 0, 0, 0, time.UTC)
)

const ownerJSON = `{"containerID":"c1","ifName":"eth0","namespace":"ns","pod":"web-0","podUID":"u1","network":"pods"}`

// TestJSONText pins the wire format: each type's sample marshals to
// exactly the JSON the API has always sent (addresses and prefixes as
// their usual text, zero ones as ""), and decodes back to the same value.
func TestJSONText(t *testing.T) {
	for _, tc := range []struct {
		name string
		v    any // a pointer to the sample
		json string
	}{
		{"Error", &api.Error{Code: api.CodeBadRequest, Message: "bad", Field: "ips[0]"},
			`{"code":"bad_request","error":"bad","field":"ips[0]"}`},
		{"Owner", &owner, ownerJSON},
		{"AllocateRequest", &api.AllocateRequest{Owner: owner, Pool: "default", Families: []string{"ipv4", "ipv6"}, IPs: api.Addrs{addr4, addr6}, Permanent: true},
			`{"owner":` + ownerJSON + `,"pool":"default","families":["ipv4","ipv6"],"ips":["10.0.0.5","fd00::5"],"permanent":true}`},
		{"AllocateRequest without IPs", &api.AllocateRequest{Owner: owner},
			`{"owner":` + ownerJSON + `}`},
		{"IPConfig", &api.IPConfig{Address: host4, Family: "ipv4", Gateway: api.GatewayV4, Block: block4},
			`{"address":"10.0.0.5/32","family":"ipv4","gateway":"169.254.1.1","block":"10.0.0.0/26"}`},
		{"IPConfig with zero values", &api.IPConfig{},
			`{"address":"","family":"","gateway":"","block":""}`},
		{"AllocateResponse", &api.AllocateResponse{Pool: "default", State: "reserved", Expires: &expires, MTU: 1450, IPs: []api.IPConfig{
			{Address: host4, Family: "ipv4", Gateway: api.GatewayV4, Block: block4},
			{Address: host6, Family: "ipv6", Gateway: api.GatewayV6, Block: block6},
		}},
			`{"pool":"default","ips":[` +
				`{"address":"10.0.0.5/32","family":"ipv4","gateway":"169.254.1.1","block":"10.0.0.0/26"},` +
				`{"address":"fd00::5/128","family":"ipv6","gateway":"fe80::ecee:eeff:feee:eeee","block":"fd00::/120"}],` +
				`"state":"reserved","expires":"2026-11-22T08:00:00Z","mtu":1450}`},
		{"ReleaseRequest", &api.ReleaseRequest{Owner: owner}, `{"owner":` + ownerJSON + `}`},
		{"ReleaseResponse", &api.ReleaseResponse{Released: []string{"10.0.0.5"}}, `{"released":["10.0.0.5"]}`},
		{"EndpointRequest", &api.EndpointRequest{Owner: owner, HostIfName: "kv0123", ContainerIfName: "eth0", ContainerMAC: "02:00:00:00:00:01",
			Netns: "/var/run/netns/p", IPs: api.Prefixes{host4, host6}},
			`{"owner":` + ownerJSON + `,"hostIfName":"kv0123","containerIfName":"eth0","containerMAC":"02:00:00:00:00:01",` +
				`"netns":"/var/run/netns/p","ips":["10.0.0.5/32","fd00::5/128"]}`},
		{"EndpointList", &api.EndpointList{Endpoints: []api.Endpoint{{ID: 7, Owner: owner, HostIfName: "kv0123", HostIfIndex: 12,
			IPs: []netip.Addr{addr4, addr6}, Datapath: "bpf", Created: expires,
			Counters: &api.Counters{PassedPackets: 1, PassedBytes: 2, DroppedPackets: 3, DroppedBytes: 4}}}},
			`{"endpoints":[{"id":7,"owner":` + ownerJSON + `,"hostIfName":"kv0123","hostIfIndex":12,` +
				`"ips":["10.0.0.5","fd00::5"],"datapath":"bpf","created":"2026-11-22T08:00:00Z",` +
				`"counters":{"passedPackets":1,"passedBytes":2,"droppedPackets":3,"droppedBytes":4}}]}`},
		{"GCRequest", &api.GCRequest{ValidAttachments: []api.Attachment{{ContainerID: "c1", IfName: "eth0"}}, Pool: "default", Network: "pods"},
			`{"validAttachments":[{"containerID":"c1","ifname":"eth0"}],"pool":"default","network":"pods"}`},
		{"GCResponse", &api.GCResponse{Released: []string{"10.0.0.5"}, Deferred: 2}, `{"released":["10.0.0.5"],"deferred":2}`},
		{"Config", &api.Config{Node: "n1", MTU: 1450, DefaultPool: "default", Pools: []string{"default"}, Datapath: "routes",
			GatewayV4: api.GatewayV4, GatewayV6: api.GatewayV6, ReservationTTL: "2m0s"},
			`{"node":"n1","mtu":1450,"defaultPool":"default","pools":["default"],"datapath":"routes",` +
				`"gatewayV4":"169.254.1.1","gatewayV6":"fe80::ecee:eeff:feee:eeee","reservationTTL":"2m0s"}`},
		{"Status", &api.Status{Node: "n1", Version: "v1", Ready: true, Restored: true, Datapath: "routes",
			Etcd:  api.EtcdStatus{Reachable: true, Endpoints: []string{"http://127.0.0.1:2379"}},
			Lease: api.LeaseStatus{ID: 5, TTL: 15, State: "held"},
			Pools: []api.PoolStatus{{Pool: "default", Family: "ipv4", Blocks: []netip.Prefix{block4}, Capacity: 64, Used: 1, Free: 63, Size: 254, ReservedRanges: 2}}},
			`{"node":"n1","version":"v1","ready":true,"restored":true,` +
				`"etcd":{"reachable":true,"embedded":false,"endpoints":["http://127.0.0.1:2379"]},` +
				`"lease":{"id":5,"ttl":15,"state":"held"},"datapath":"routes",` +
				`"pools":[{"pool":"default","family":"ipv4","blocks":["10.0.0.0/26"],"capacity":64,"used":1,"reserved":0,"free":63,"borrowed":0,"lent":0,"size":254,"reservedRanges":2,"exhausted":false}]}`},
		{"AllocationList", &api.AllocationList{Allocations: []api.Allocation{{Pool: "default", Address: host4, Block: block4, State: "allocated"}}},
			`{"allocations":[{"pool":"default","address":"10.0.0.5/32","block":"10.0.0.0/26","state":"allocated"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := json.Marshal(tc.v)
			require.NoError(t, err)
			require.JSONEq(t, tc.json, string(got))
			require.Equal(t, tc.json, string(got), "field order too")

			back := reflect.New(reflect.TypeOf(tc.v).Elem())
			require.NoError(t, json.Unmarshal(got, back.Interface()))
			require.Equal(t, tc.v, back.Interface())
		})
	}
}

// TestDecodeRefusesMalformedAddresses: a malformed address is an error
// when decoding, never a zero value; in a request's list the error names
// the entry.
func TestDecodeRefusesMalformedAddresses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		into  any
		json  string
		field string // the path of a request list's bad entry
	}{
		{"requested ip", &api.AllocateRequest{}, `{"ips":["10.0.0.300"]}`, "ips.[0]"},
		{"second requested ip", &api.AllocateRequest{}, `{"ips":["10.0.0.5","nope"]}`, "ips.[1]"},
		{"empty requested ip", &api.AllocateRequest{}, `{"ips":[""]}`, "ips.[0]"},
		{"requested ip in CIDR form", &api.AllocateRequest{}, `{"ips":["10.0.0.5/24"]}`, "ips.[0]"},
		{"requested ip not a string", &api.AllocateRequest{}, `{"ips":[5]}`, "ips"},
		{"endpoint ip", &api.EndpointRequest{}, `{"ips":["10.0.0.5/33"]}`, "ips.[0]"},
		{"endpoint ip without prefix", &api.EndpointRequest{}, `{"ips":["10.0.0.5"]}`, "ips.[0]"},
		{"allocated address", &api.IPConfig{}, `{"address":"ten"}`, ""},
		{"gateway", &api.IPConfig{}, `{"gateway":"169.254.1"}`, ""},
		{"block", &api.Allocation{}, `{"block":"10.0.0.0"}`, ""},
		{"endpoint address", &api.Endpoint{}, `{"ips":["10.0.0.5/32"]}`, ""},
		{"config gateway", &api.Config{}, `{"gatewayV6":"fe80::ecee::1"}`, ""},
		{"pool block", &api.PoolStatus{}, `{"blocks":["10.0.0.0/26","x"]}`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := json.Unmarshal([]byte(tc.json), tc.into)
			require.Error(t, err)
			if tc.field != "" {
				var ute *json.UnmarshalTypeError
				require.ErrorAs(t, err, &ute)
				require.Equal(t, tc.field, ute.Field)
			}
		})
	}
}

func TestAddrsDecodeNullAndEmpty(t *testing.T) {
	var r api.AllocateRequest
	require.NoError(t, json.Unmarshal([]byte(`{"ips":null}`), &r))
	require.Nil(t, r.IPs)
	require.NoError(t, json.Unmarshal([]byte(`{"ips":[]}`), &r))
	require.Empty(t, r.IPs)
	var e api.EndpointRequest
	require.NoError(t, json.Unmarshal([]byte(`{"ips":["10.0.0.5/32"]}`), &e))
	require.Equal(t, api.Prefixes{host4}, e.IPs)
}

func TestOwnerKey(t *testing.T) {
	require.Equal(t, "c1/eth0", owner.Key())
	require.Equal(t, owner.Key(), api.Owner{ContainerID: "c1", IfName: "eth0"}.Key(), "only the attachment's identity")
}
