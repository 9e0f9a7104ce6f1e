package schema

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

func TestLevels(t *testing.T) {
	require.Equal(t, Level(4), Highest())
	require.Equal(t, Base, LevelOf(nil), "v0.1.0 names no features")
	require.Equal(t, Level(4), LevelOf(Names()))
	require.Equal(t, Level(2), LevelOf([]string{PoolMaxBlocks}), "a node without migration-owner is at level 2")
	require.Equal(t, Base, LevelOf([]string{MigrationOwner}), "levels are cumulative: level 3 without level 2's feature is level 1")
	require.Equal(t, Level(4), LevelOf(append(Names(), "from-the-future")), "an unknown feature does not raise past Highest")
	require.Equal(t, Base, LevelOf([]string{"from-the-future"}))
	require.True(t, Enabled(PoolMaxBlocks, 2))
	require.False(t, Enabled(PoolMaxBlocks, 1))
	require.Equal(t, []string{PoolMaxBlocks, MigrationOwner, Import}, FeaturesAbove(1))
	require.Equal(t, []string{MigrationOwner, Import}, FeaturesAbove(2))
	require.True(t, Enabled(MigrationOwner, 3))
	require.False(t, Enabled(MigrationOwner, 2))
	require.Equal(t, Level(3), MigrationNeeds())
	require.Equal(t, Level(4), ImportNeeds())
	require.Equal(t, Base, PoolNeeds(allocator.Pool{}))
	require.Equal(t, Level(2), PoolNeeds(allocator.Pool{MaxBlocksPerNode: 3}))

	for _, tc := range []struct {
		stored    Level
		downgrade bool
		live      []Level
		to        Level
		ok        bool
	}{
		{1, false, []Level{2, 2}, 2, true},
		{1, false, []Level{2, 1}, 1, false},
		{1, true, []Level{2, 2}, 1, false},
		{2, false, []Level{2}, 2, false},
		{2, false, []Level{1}, 1, false}, // never lowered by the agents
		{1, false, nil, 1, false},
	} {
		to, ok := RaiseTo(tc.stored, tc.downgrade, tc.live)
		require.Equal(t, tc.ok, ok, "%+v", tc)
		if ok {
			require.Equal(t, tc.to, to, "%+v", tc)
		}
	}

	for in, want := range map[string]Level{"v0.1.0": 1, "v0.1.3": 1, "1": 1, "level-2": 2, "3": 3, "v0.2.0": 4, "v0.2.0-rc.1": 4, "v1.0.0": 4, "4": 4} {
		got, err := ParseTarget(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"v0.0.9", "5", "0", "latest", "0.1.0", "v1.2"} {
		_, err := ParseTarget(in)
		require.Error(t, err, in)
	}
}
