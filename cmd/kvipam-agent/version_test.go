package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/foundation/buildinfo"
)

// TestVersionSubcommandLikeFlag: `kvipam-agent version` prints the line
// --version prints; an argument after it is refused.
func TestVersionSubcommandLikeFlag(t *testing.T) {
	var out, errb bytes.Buffer
	require.Equal(t, 0, runVersion(nil, &out, &errb), errb.String())
	var flagOut bytes.Buffer
	printVersion(&flagOut)
	require.Equal(t, flagOut.String(), out.String())
	require.Equal(t, "kvipam-agent "+buildinfo.Read().String()+"\n", out.String())

	out.Reset()
	require.Equal(t, 2, runVersion([]string{"extra"}, &out, &errb))
	require.Empty(t, out.String())
	require.True(t, strings.Contains(errb.String(), `kvipam-agent version: unexpected argument "extra"`), errb.String())
}
