package allocator_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
)

func TestSelector(t *testing.T) {
	r1 := map[string]string{"rack": "r1", "zone": "a", "gpu": ""}
	r2 := map[string]string{"rack": "r2", "zone": "a"}
	for _, tc := range []struct {
		sel    string
		r1, r2 bool
		str    string
	}{
		{sel: "", r1: true, r2: true, str: ""},
		{sel: "rack=r1", r1: true, str: "rack=r1"},
		{sel: "rack==r2", r2: true, str: "rack=r2"},
		{sel: " rack != r1 ", r2: true, str: "rack!=r1"},
		{sel: "zone=a,gpu", r1: true, str: "zone=a,gpu"},
		{sel: "zone=a,!gpu", r2: true, str: "zone=a,!gpu"},
		{sel: "missing!=x", r1: true, r2: true, str: "missing!=x"},
		{sel: "kvipam.io/rack=r1", str: "kvipam.io/rack=r1"},
	} {
		t.Run(tc.sel, func(t *testing.T) {
			s, err := allocator.ParseSelector(tc.sel)
			require.NoError(t, err)
			require.Equal(t, tc.r1, s.Matches(r1))
			require.Equal(t, tc.r2, s.Matches(r2))
			require.Equal(t, tc.str, s.String())
			again, err := allocator.ParseSelector(s.String())
			require.NoError(t, err)
			require.Equal(t, s, again)
		})
	}
	for _, bad := range []string{"rack=r 1", "=r1", "rack=r1,", "!", "ra ck", "a/b/c=1", "rack=-r1"} {
		_, err := allocator.ParseSelector(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidSelector, bad)
	}
	p := allocator.Pool{Name: "p", NodeSelector: "rack=", CIDRs: nil}
	require.True(t, p.Selects(map[string]string{"rack": ""}))
	p.NodeSelector = "rack=r 1"
	require.False(t, p.Selects(r1), "a selector that does not parse selects nothing")
}

func TestParseLabels(t *testing.T) {
	l, err := allocator.ParseLabels("rack=r1, zone=a,kvipam.io/gpu=")
	require.NoError(t, err)
	require.Equal(t, map[string]string{"rack": "r1", "zone": "a", "kvipam.io/gpu": ""}, l)
	require.Equal(t, "kvipam.io/gpu=,rack=r1,zone=a", allocator.FormatLabels(l))
	for _, bad := range []string{"rack", "rack=r1,rack=r2", "=x", "rack=r/1"} {
		_, err := allocator.ParseLabels(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidSelector, bad)
	}
}
