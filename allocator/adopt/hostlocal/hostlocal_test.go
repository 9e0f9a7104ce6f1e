package hostlocal

import (
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/adopt"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestRead reads a directory as host-local (containernetworking/plugins
// v1.9.1's disk backend) leaves it: address files of "id\r\nifname", its
// lock and last_reserved_ip files; anything else is refused.
func TestRead(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "mynet")
	require.NoError(t, os.Mkdir(dir, 0o755))
	for name, body := range map[string]string{
		"10.1.0.2": "abc123\r\neth0", "fd00::5": "abc123\r\neth0", "lock": "", "last_reserved_ip.0": "10.1.0.2",
	} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600))
	}
	got, err := Read(dir, "n1")
	require.NoError(t, err)
	o := records.Owner{ContainerID: "abc123", IfName: "eth0"}
	require.ElementsMatch(t, []adopt.Allocation{{Addr: netip.MustParseAddr("10.1.0.2"), Owner: o, Node: "n1"}, {Addr: netip.MustParseAddr("fd00::5"), Owner: o, Node: "n1"}}, got)
	require.Equal(t, "mynet", Network(dir))
	require.Equal(t, "host-local:n1:mynet", SourceID("n1", "mynet"))

	require.NoError(t, os.WriteFile(filepath.Join(dir, "10.1.0.3"), []byte("oldstyle"), 0o600))
	_, err = Read(dir, "n1")
	require.ErrorIs(t, err, records.ErrBadRequest, "a file with no interface name")
	require.NoError(t, os.Remove(filepath.Join(dir, "10.1.0.3")))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "stray"), nil, 0o600))
	_, err = Read(dir, "n1")
	require.ErrorIs(t, err, records.ErrBadRequest, "a file that is not host-local's")
	_, err = Read(filepath.Join(dir, "missing"), "n1")
	require.Error(t, err)
}
