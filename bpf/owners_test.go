//go:build linux

package bpf

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// requireOwnersMatch checks the mirror of the addrs and ifaces maps
// against the maps themselves.
func requireOwnersMatch(tb testing.TB, d *Datapath) {
	tb.Helper()
	d.mapsMu.Lock()
	defer d.mapsMu.Unlock()
	mirror := d.owners
	require.NoError(tb, d.loadOwners())
	fresh := d.owners
	d.owners = mirror
	require.Equal(tb, fresh, mirror, "the mirror of the addrs and ifaces maps differs from the maps")
}
