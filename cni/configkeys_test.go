package cni

import (
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"
)

// TestUnknownConfigKeyRefused: a key kvipam does not know, in an object
// kvipam owns (the kvipam plugin's configuration, kvipam-ipam's "ipam"),
// is refused with code 7, naming the key and the nearest known one; the
// keys the CNI spec lets a runtime add, and a main plugin's own keys
// beside kvipam-ipam's "ipam", are accepted.
func TestUnknownConfigKeyRefused(t *testing.T) {
	tests := []struct {
		name    string
		parse   func([]byte) (*Config, error)
		conf    string
		wantErr string // "" when the configuration is accepted
		noHint  bool
	}{
		{name: "kvipam: a typo of pool", parse: ParseConfig,
			conf:    `{"cniVersion":"1.0.0","name":"pods","type":"kvipam","pol":"blue"}`,
			wantErr: `unknown key "pol": did you mean "pool"?`},
		{name: "kvipam: a typo of agentSocket", parse: ParseConfig,
			conf:    `{"cniVersion":"1.0.0","name":"pods","type":"kvipam","agentSocekt":"/run/x.sock"}`,
			wantErr: `unknown key "agentSocekt": did you mean "agentSocket"?`},
		{name: "kvipam: a key in the wrong case", parse: ParseConfig,
			conf:    `{"cniVersion":"1.0.0","name":"pods","type":"kvipam","Pool":"blue"}`,
			wantErr: `unknown key "Pool": did you mean "pool"?`},
		{name: "kvipam: nothing near", parse: ParseConfig,
			conf:    `{"cniVersion":"1.0.0","name":"pods","type":"kvipam","hairpinMode":true}`,
			wantErr: `unknown key "hairpinMode"`, noHint: true},
		{name: "kvipam: every key of the CNI spec but ipMasq (TestIPMasqNeverIgnored)", parse: ParseConfig,
			conf: `{"cniVersion":"1.1.0","name":"pods","type":"kvipam","capabilities":{"ips":true},"args":{"cni":{}},
				"dns":{},"runtimeConfig":{"ips":[]},"cni.dev/valid-attachments":[],"cni.dev/attachments":[],
				"cni.dev/a-later-key":1}`},
		{name: "kvipam-ipam: a typo of pool under ipam", parse: ParseIPAMConfig,
			conf:    `{"cniVersion":"1.0.0","name":"br","type":"bridge","ipam":{"type":"kvipam-ipam","pol":"blue"}}`,
			wantErr: `ipam: unknown key "pol": did you mean "pool"?`},
		{name: "kvipam-ipam: a typo of a gateway", parse: ParseIPAMConfig,
			conf:    `{"cniVersion":"1.0.0","name":"br","type":"bridge","ipam":{"type":"kvipam-ipam","gatewayv4":"10.0.0.1"}}`,
			wantErr: `ipam: unknown key "gatewayv4": did you mean "gatewayV4"?`},
		{name: "kvipam-ipam: the main plugin's keys are its own", parse: ParseIPAMConfig,
			conf: `{"cniVersion":"1.0.0","name":"br","type":"bridge","bridge":"cni0","isGateway":true,"hairpinMode":true,"pol":"x",
				"ipam":{"type":"kvipam-ipam","pool":"blue","gatewayV4":"10.0.0.1","addressPrefix":"host"}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.parse([]byte(tt.conf))
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			require.Equal(t, uint(types.ErrInvalidNetworkConfig), Code(err), "code of %v", err)
			require.Contains(t, err.Error(), tt.wantErr)
			if tt.noHint {
				require.NotContains(t, err.Error(), "did you mean")
			}
		})
	}
}

// A pod set up before kvipam refused unknown keys is still torn down:
// DEL takes the key, with a warning.
func TestUnknownConfigKeyDelStillReleases(t *testing.T) {
	e := newPluginEnv(t, false)
	require.NoError(t, e.p.Del(e.args("c1", e.conf(`,"pol":"blue"`))))
	require.Contains(t, e.ag.Calls(), "release c1/eth0")
	require.Contains(t, e.stderr.String(), `unknown key \"pol\"`)
}
