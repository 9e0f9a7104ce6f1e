package cni

import (
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
)

// TestIPMasqNeverIgnored: the CNI spec's ipMasq in the kvipam plugin's
// configuration is refused, true or false, with an invalid-configuration
// error (code 7) that names the pool setting that decides instead; ADD
// then asks the agent for nothing. DEL still tears the pod down (a pod
// set up before the refusal must go). Beside kvipam-ipam, ipMasq is the
// main plugin's (bridge honours it) and kvipam leaves it to it.
func TestIPMasqNeverIgnored(t *testing.T) {
	for _, v := range []string{"true", "false"} {
		t.Run("ipMasq "+v, func(t *testing.T) {
			e := newPluginEnv(t, false)
			err := e.run(t, e.p.Add, e.args("c1", e.conf(`,"ipMasq":`+v)))
			require.Equal(t, uint(types.ErrInvalidNetworkConfig), Code(err), "%v", err)
			require.ErrorContains(t, err, "ipMasq: kvipam does not masquerade per network")
			require.ErrorContains(t, err, "kvipamctl pool set-masquerade POOL on|off|default")
			require.Empty(t, e.ag.Calls(), "nothing asked of the agent")

			_, err = ParseConfig(e.conf(`,"ipMasq":` + v))
			require.Equal(t, uint(types.ErrInvalidNetworkConfig), Code(err), "CHECK, STATUS and GC read it the same: %v", err)

			a := e.args("c1", e.conf(`,"ipMasq":`+v))
			a.Netns = ""
			require.NoError(t, e.run(t, e.p.Funcs().Del, a), "DEL tears down all the same")
			require.Equal(t, []string{"release c1/eth0"}, e.ag.Calls())
			c, err := ParseDelConfig(e.conf(`,"ipMasq":` + v))
			require.NoError(t, err)
			require.ErrorContains(t, c.UnknownKey, "ipMasq", "DEL logs what ADD refuses")
		})
	}
	_, err := ParseIPAMConfig([]byte(`{"cniVersion":"1.0.0","name":"br","type":"bridge","ipMasq":true,"ipam":{"type":"kvipam-ipam"}}`))
	require.NoError(t, err, "the main plugin's ipMasq is the main plugin's")
}
