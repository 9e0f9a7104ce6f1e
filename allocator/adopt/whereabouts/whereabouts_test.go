package whereabouts

import (
	"net/netip"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/adopt"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestParseExport reads a List as kubectl prints it of whereabouts
// v0.9.2's objects (testdata/export.json: an IPv4 IPPool, an IPv6 one of
// a named network, their OverlappingRangeIPReservations, the pods): each
// allocation's address is its offset from the range's first address, its
// node the pod's; allocations of pods gone or ended, or that an
// overlapping-range reservation gives to another pod, are skipped with a
// reason.
func TestParseExport(t *testing.T) {
	data, err := os.ReadFile("testdata/export.json")
	require.NoError(t, err)
	ex, err := Parse(data)
	require.NoError(t, err)
	require.Len(t, ex.Pools, 2)
	require.Len(t, ex.Reservations, 3)
	got, skipped, err := ex.Allocations(nil)
	require.NoError(t, err)
	web0 := records.Owner{ContainerID: "3b1f0c2a9d", IfName: "net1", Namespace: "default", Pod: "web-0", PodUID: "0b6d0a5e-1111-4e2b-8a55-6f8e1c4d2a01"}
	web0v6 := web0
	web0v6.IfName = "net2"
	require.Equal(t, []adopt.Allocation{
		{Addr: netip.MustParseAddr("10.5.0.1"), Owner: web0, Node: "node-1"},
		{Addr: netip.MustParseAddr("10.5.0.65"), Owner: records.Owner{ContainerID: "91ad03c7e2", IfName: "net1", Namespace: "team", Pod: "db-0", PodUID: "0b6d0a5e-3333-4e2b-8a55-6f8e1c4d2a03"}, Node: "node-2"},
		{Addr: netip.MustParseAddr("fd00:5::3"), Owner: web0v6, Node: "node-1"},
	}, got)
	why := map[string]string{}
	for _, s := range skipped {
		why[s.Addr.String()] = s.Why
	}
	require.Len(t, why, 3, "%+v", skipped)
	require.Contains(t, why["10.5.0.2"], "default/other", "the reservation names another pod")
	require.Contains(t, why["10.5.0.9"], "not in the export")
	require.Contains(t, why["10.5.0.10"], "Succeeded")

	only, _, err := ex.Allocations([]string{"v6net-fd00-5---120"})
	require.NoError(t, err)
	require.Len(t, only, 1)
}

// TestParseRefusesBadInput: what is not such an export is an error, not
// an empty import.
func TestParseRefusesBadInput(t *testing.T) {
	for name, in := range map[string]string{
		"not json":      `{`,
		"not a list":    `{"kind":"IPPool","apiVersion":"whereabouts.cni.cncf.io/v1alpha1"}`,
		"another kind":  `{"kind":"List","items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"x"}}]}`,
		"another group": `{"kind":"List","items":[{"apiVersion":"example.com/v1","kind":"IPPool","metadata":{"name":"x"}}]}`,
	} {
		_, err := Parse([]byte(in))
		require.ErrorIs(t, err, records.ErrBadRequest, name)
	}
	for name, in := range map[string]string{
		"bad range":    `{"kind":"List","items":[{"apiVersion":"whereabouts.cni.cncf.io/v1alpha1","kind":"IPPool","metadata":{"name":"x"},"spec":{"range":"10.0.0.0","allocations":{}}}]}`,
		"bad offset":   `{"kind":"List","items":[{"apiVersion":"whereabouts.cni.cncf.io/v1alpha1","kind":"IPPool","metadata":{"name":"x"},"spec":{"range":"10.0.0.0/24","allocations":{"x":{"id":"a","podref":"a/b","ifname":"e"}}}}]}`,
		"past the end": `{"kind":"List","items":[{"apiVersion":"whereabouts.cni.cncf.io/v1alpha1","kind":"IPPool","metadata":{"name":"x"},"spec":{"range":"255.255.255.0/24","allocations":{"300":{"id":"a","podref":"a/b","ifname":"e"}}}}]}`,
	} {
		ex, err := Parse([]byte(in))
		require.NoError(t, err, name)
		_, _, err = ex.Allocations(nil)
		require.ErrorIs(t, err, records.ErrBadRequest, name)
	}
}
