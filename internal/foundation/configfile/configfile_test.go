package configfile

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/foundation/duration"
)

type dur struct{ time.Duration }

func (d *dur) UnmarshalJSON(b []byte) (err error) {
	d.Duration, err = duration.Decode(b)
	return err
}

type inner struct {
	Endpoints []string `json:"endpoints"`
	Timeout   dur      `json:"timeout"`
}

type item struct {
	Name  string         `json:"name"`
	CIDRs []netip.Prefix `json:"cidrs"`
	Tags  []inner        `json:"tags"`
}

type common struct {
	Level string `json:"level"`
}

type config struct {
	common
	Node   string            `json:"node"`
	Inner  inner             `json:"inner"`
	Items  []item            `json:"items"`
	Labels map[string]string `json:"labels"`
	Hidden string            `json:"-"`
	Ptr    *inner            `json:"ptr"`
}

// selfDecoder is a section with its own decoder: the strictness it would
// bypass is refused.
type selfDecoder struct{ A string }

func (s *selfDecoder) UnmarshalJSON(b []byte) error {
	var m map[string]any
	return json.Unmarshal(b, &m)
}

func TestUnmarshalStrict(t *testing.T) {
	var c config
	require.NoError(t, Unmarshal([]byte(`
level: debug
node: 123
inner: {endpoints: [a], timeout: 2s}
items: [{name: x, cidrs: [10.0.0.0/8], tags: [{timeout: 0}]}]
labels: {anything: goes}
ptr: {timeout: 1m}
`), &c))
	require.Equal(t, "debug", c.Level, "an embedded struct's keys are promoted")
	require.Equal(t, "123", c.Node, "a scalar is read into a string as sigs.k8s.io/yaml does")
	require.Equal(t, 2*time.Second, c.Inner.Timeout.Duration)
	require.Equal(t, time.Minute, c.Ptr.Timeout.Duration)
	require.Equal(t, "goes", c.Labels["anything"])

	for _, tc := range []struct{ name, doc, want string }{
		{"nested", "inner: {endpoint: [a]}", "inner.endpoint: unknown key (did you mean endpoints?)"},
		{"list of sections", "items: [{name: x}, {name: y, tags: [{}, {timout: 1s}]}]", "items[1].tags[1].timout: unknown key (did you mean timeout?)"},
		{"case", "Node: n", "Node: unknown key (did you mean node?)"},
		{"separators", "inner: {END_POINTS: [a]}", "inner.END_POINTS: unknown key (did you mean endpoints?)"},
		{"another section's key", "endpoints: [a]", "endpoints: unknown key (did you mean inner.endpoints or items[].tags[].endpoints or ptr.endpoints?)"},
		{"nothing close", "zzz: 1", "zzz: unknown key"},
		{"skipped field", "Hidden: x", "Hidden: unknown key"},
		{"bare number", "inner: {timeout: 5}", "inner.timeout: 5 has no unit"},
		{"not a duration", "inner: {timeout: soon}", `inner.timeout: "soon" is not a duration`},
		{"bad prefix", "items: [{cidrs: [10.0.0.0/33]}]", "items[0].cidrs[0]:"},
		{"key twice", "node: a\nnode: b", "already set"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var c config
			require.ErrorContains(t, Unmarshal([]byte(tc.doc), &c), tc.want)
		})
	}
	var s struct {
		S selfDecoder `json:"s"`
	}
	require.ErrorContains(t, Unmarshal([]byte("s: {A: x}"), &s), "s: configfile.selfDecoder decodes itself and cannot be read strictly")
}

func TestKeys(t *testing.T) {
	var paths []string
	for _, k := range Keys(reflect.TypeFor[config]()) {
		paths = append(paths, k.Path)
	}
	require.Equal(t, []string{
		"level", "node", "inner", "inner.endpoints", "inner.timeout",
		"items", "items[].name", "items[].cidrs", "items[].tags", "items[].tags[].endpoints", "items[].tags[].timeout",
		"labels", "ptr", "ptr.endpoints", "ptr.timeout",
	}, paths)
}
