package whereabouts

import (
	"net/netip"
	"testing"
)

// TestWhereaboutsStaleAllocationOfLivePodName: a pod re-created under
// its name (a StatefulSet's, or any pod whose earlier sandbox's DEL never
// reached whereabouts) while the earlier allocation stays in the IPPool.
// Only the address the pod runs with is imported, read from its podIPs
// or, on a secondary network, from Multus' network-status annotation;
// the other is skipped, not imported as the dead sandbox's.
func TestWhereaboutsStaleAllocationOfLivePodName(t *testing.T) {
	const pool = `{"apiVersion":"whereabouts.cni.cncf.io/v1alpha1","kind":"IPPool","metadata":{"name":"10.248.1.0-24","namespace":"kube-system"},
  "spec":{"range":"10.248.1.0/24","allocations":{
    "10":{"id":"deadsandbox","ifname":"net1","podref":"db/pg-0"},
    "12":{"id":"livesandbox","ifname":"net1","podref":"db/pg-0"}}}}`
	for name, pod := range map[string]string{
		"podIPs": `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"pg-0","namespace":"db","uid":"u2"},
  "spec":{"nodeName":"n1"},"status":{"phase":"Running","podIPs":[{"ip":"10.248.1.12"}]}}`,
		"network-status": `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"pg-0","namespace":"db","uid":"u2",
  "annotations":{"k8s.v1.cni.cncf.io/network-status":"[{\"name\":\"default\",\"interface\":\"eth0\",\"ips\":[\"10.1.0.7\"]},{\"name\":\"db/wb\",\"interface\":\"net1\",\"ips\":[\"10.248.1.12\"]}]"}},
  "spec":{"nodeName":"n1"},"status":{"phase":"Running","podIPs":[{"ip":"10.1.0.7"}]}}`,
	} {
		ex, err := Parse([]byte(`{"apiVersion":"v1","kind":"List","items":[` + pool + `,` + pod + `]}`))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		allocs, skipped, err := ex.Allocations(nil)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(allocs) != 1 || allocs[0].Addr != netip.MustParseAddr("10.248.1.12") || allocs[0].Owner.ContainerID != "livesandbox" {
			t.Errorf("%s: want only the live sandbox's 10.248.1.12 imported, got %+v", name, allocs)
		}
		if len(skipped) != 1 || skipped[0].Addr != netip.MustParseAddr("10.248.1.10") {
			t.Errorf("%s: want the dead sandbox's 10.248.1.10 skipped, got %+v", name, skipped)
		}
	}
}
