package duration

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestDecode(t *testing.T) {
	for in, want := range map[string]time.Duration{`"1s"`: time.Second, `"1m30s"`: 90 * time.Second, `0`: 0, `"0"`: 0} {
		d, err := Decode([]byte(in))
		require.NoError(t, err, in)
		require.Equal(t, want, d, in)
	}
	for _, in := range []string{`1`, `1.5`, `true`, `"1"`, `{}`} {
		_, err := Decode([]byte(in))
		require.Error(t, err, in)
	}
}
