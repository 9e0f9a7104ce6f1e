package buildinfo

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestFromBuild(t *testing.T) {
	stamped := &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.modified", Value: "true"},
	}}
	for _, tc := range []struct {
		name         string
		bi           *debug.BuildInfo
		ldV, ldC     string
		wantV, wantC string
	}{
		{"nothing known", nil, "", "", "dev", ""},
		{"vcs stamp", stamped, "", "", "dev", "abc123-modified"},
		{"ldflags win", stamped, "v1.2.3-4-gdef-dirty", "def456", "v1.2.3-4-gdef-dirty", "def456"},
		{"go install module@version", &debug.BuildInfo{Main: debug.Module{Version: "v0.9.0"}}, "", "", "v0.9.0", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			i := fromBuild(tc.bi, tc.ldV, tc.ldC)
			require.Equal(t, tc.wantV, i.Version)
			require.Equal(t, tc.wantC, i.Commit)
			require.Contains(t, i.String(), tc.wantV)
		})
	}
}
