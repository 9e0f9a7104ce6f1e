package agent

import (
	"errors"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
)

// TestCheckPortMappings: an endpoint request's mappings are refused with
// the field named when bad, and on the routes datapath at all; a host
// address of 0.0.0.0 or :: means every address, as with portmap; and
// each mapping is served for every family the pod has, or its hostIP's.
func TestCheckPortMappings(t *testing.T) {
	ok := []api.PortMapping{{HostPort: 8080, ContainerPort: 80, Protocol: "TCP"}, {HostPort: 53, ContainerPort: 53, Protocol: "udp", HostIP: "0.0.0.0"}}
	got, err := checkPortMappings(ok, DatapathBPF)
	require.NoError(t, err)
	require.Equal(t, []api.PortMapping{{HostPort: 8080, ContainerPort: 80, Protocol: "tcp"}, {HostPort: 53, ContainerPort: 53, Protocol: "udp"}}, got)

	_, err = checkPortMappings(ok, DatapathRoutes)
	var fe *FieldError
	require.True(t, errors.As(err, &fe), "%v", err)
	require.Equal(t, "portMappings", fe.Field)
	require.Contains(t, fe.Msg, "portmap")

	for _, pm := range []api.PortMapping{
		{HostPort: 8080, ContainerPort: 80, Protocol: "sctp"},
		{HostPort: 0, ContainerPort: 80},
		{HostPort: 8080, ContainerPort: 70000},
		{HostPort: 8080, ContainerPort: 80, HostIP: "node1"},
	} {
		_, err := checkPortMappings([]api.PortMapping{pm}, DatapathBPF)
		require.True(t, errors.As(err, &fe), "%+v: %v", pm, err)
		require.Equal(t, "portMappings[0]", fe.Field)
	}

	pod := []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")}
	ports, err := bpfPorts([]api.PortMapping{{HostPort: 8080, ContainerPort: 80, Protocol: "tcp"}, {HostPort: 8081, ContainerPort: 81, Protocol: "udp", HostIP: "fd00::1"}}, pod)
	require.NoError(t, err)
	require.Len(t, ports, 3, "one per family without hostIP, the hostIP's family only with it")
	_, err = bpfPorts([]api.PortMapping{{HostPort: 8080, ContainerPort: 80, Protocol: "tcp", HostIP: "fd00::1"}}, pod[:1])
	require.True(t, errors.As(err, &fe), "a hostIP of a family the pod has no address of: %v", err)
}
