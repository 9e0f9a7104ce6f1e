package cni

import (
	"path/filepath"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"
)

// The example conflists in deploy/cni parse, and their kvipam parts are
// valid configurations, as the plugins would receive them from libcni.
func TestDeployConflists(t *testing.T) {
	files, err := filepath.Glob("../deploy/cni/*.conflist")
	require.NoError(t, err)
	require.Len(t, files, 4)
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			l, err := libcni.ConfListFromFile(f)
			require.NoError(t, err)
			found := 0
			for _, p := range l.Plugins {
				conf, err := libcni.InjectConf(p, map[string]any{"name": l.Name, "cniVersion": l.CNIVersion})
				require.NoError(t, err)
				switch {
				case p.Network.Type == "kvipam":
					_, err = ParseConfig(conf.Bytes)
					found++
				case p.Network.IPAM.Type == "kvipam-ipam":
					_, err = ParseIPAMConfig(conf.Bytes)
					found++
				}
				require.NoError(t, err, "plugin %s", p.Network.Type)
			}
			require.Equal(t, 1, found, "one kvipam plugin in %s", f)
		})
	}
}
