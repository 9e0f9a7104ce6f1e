package agent

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

// TestBuildInfoMetric: the agent's registry has kvipam_build_info, 1,
// labelled with the version it was given, the build's commit and Go
// version.
func TestBuildInfoMetric(t *testing.T) {
	m := newMetrics("v1.2.3-test")
	mfs, err := m.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "kvipam_build_info" {
			continue
		}
		require.Len(t, mf.GetMetric(), 1)
		got := map[string]string{}
		for _, l := range mf.GetMetric()[0].GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		bi := buildinfo.Read()
		commit := bi.Commit
		if commit == "" {
			commit = "unknown"
		}
		require.Equal(t, map[string]string{"version": "v1.2.3-test", "commit": commit, "goversion": bi.Go}, got)
		require.Equal(t, 1.0, mf.GetMetric()[0].GetGauge().GetValue())
		return
	}
	t.Fatal("no kvipam_build_info")
}
