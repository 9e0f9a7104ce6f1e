package allocator

import (
	"encoding/json"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestPoolCooldown: a pool's reuse cooldown is the default when its spec
// sets none, 0 reuses at once, it is stored as a duration a person reads
// ("2m10s"), absent when unset, and a value out of range or not a
// duration is refused, naming the field.
func TestPoolCooldown(t *testing.T) {
	p := Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")}, BlockSizeV4: 26}
	require.Equal(t, DefaultReuseCooldown, p.Cooldown())
	b, err := json.Marshal(p)
	require.NoError(t, err)
	require.NotContains(t, string(b), "reuseCooldown", "unset is absent")

	p.ReuseCooldown = DurationOf(130 * time.Second)
	require.NoError(t, p.Validate())
	b, err = json.Marshal(p)
	require.NoError(t, err)
	require.Contains(t, string(b), `"reuseCooldown":"2m10s"`)
	var back Pool
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, 130*time.Second, back.Cooldown())

	p.ReuseCooldown = DurationOf(0)
	require.NoError(t, p.Validate())
	require.Zero(t, p.Cooldown(), "0 reuses at once")
	b, err = json.Marshal(p)
	require.NoError(t, err)
	require.Contains(t, string(b), `"reuseCooldown":"0s"`, "0 is stored, not taken for unset")

	for _, d := range []time.Duration{-time.Second, MaxReuseCooldown + time.Second} {
		p.ReuseCooldown = DurationOf(d)
		require.ErrorIs(t, p.Validate(), ErrInvalidPool, "%s", d)
		require.ErrorContains(t, p.Validate(), "reuseCooldown "+d.String()+": want 0 (reuse at once) to 1h0m0s")
	}
	require.ErrorContains(t, json.Unmarshal([]byte(`{"reuseCooldown":30}`), &back), "30 has no unit")
	require.ErrorContains(t, json.Unmarshal([]byte(`{"reuseCooldown":"soon"}`), &back), `"soon" is not a duration`)
	require.NoError(t, json.Unmarshal([]byte(`{"reuseCooldown":0}`), &back), "0 needs no unit")
	require.Zero(t, back.Cooldown())
}
