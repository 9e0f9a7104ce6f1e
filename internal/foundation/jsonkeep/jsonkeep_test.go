package jsonkeep_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

type inner struct {
	A string `json:"a"`
	jsonkeep.Unknown
}

// flat is embedded in outer: its fields are outer's members, and so are
// the members outer does not know (outer's own Unknown is the shallower).
type flat struct {
	E string `json:"e,omitempty"`
	jsonkeep.Unknown
}

type outer struct {
	Name  string    `json:"name"`
	Skip  int       `json:"-"`
	In    inner     `json:"in"`
	Ptr   *inner    `json:"ptr,omitempty"`
	List  []inner   `json:"list,omitempty"`
	Array [1]inner  `json:"array"`
	At    time.Time `json:"at"`
	Map   map[string]inner
	flat
	jsonkeep.Unknown `json:"-"`
}

// noKeeper has no Unknown: it decodes and encodes as encoding/json does.
type noKeeper struct {
	A string `json:"a"`
}

func TestKeepsUnknownMembers(t *testing.T) {
	zero := `"in":{"a":""},"array":[{"a":""}],"at":"0001-01-01T00:00:00Z","Map":null`
	for _, tc := range []struct {
		name, in, want string
	}{
		{"none", `{"name":"n"}`, `{"name":"n",` + zero + `}`},
		{"top", `{"name":"n", "future" : { "x" : [1, 2] } }`, `{"name":"n",` + zero + `,"future":{"x":[1,2]}}`},
		{"nested", `{"in":{"a":"x","f":true},"ptr":{"a":"p","f":null},"list":[{"a":"1"},{"a":"2","f":"s"}],"array":[{"f":1}]}`,
			`{"name":"","in":{"a":"x","f":true},"ptr":{"a":"p","f":null},"list":[{"a":"1"},{"a":"2","f":"s"}],"array":[{"a":"","f":1}],"at":"0001-01-01T00:00:00Z","Map":null}`},
		// encoding/json matches member names to fields in any case: a
		// member it decodes into a field is not kept.
		{"case", `{"NAME":"n","In":{"A":"x"},"future":1}`, `{"name":"n","in":{"a":"x"},"array":[{"a":""}],"at":"0001-01-01T00:00:00Z","Map":null,"future":1}`},
		{"embedded", `{"e":"x","E2":1}`, `{"name":"",` + zero + `,"e":"x","E2":1}`},
		// A field encoding/json skips takes no member: the member is kept.
		{"skipped field", `{"Skip":5}`, `{"name":"",` + zero + `,"Skip":5}`},
		{"later of two", `{"f":1,"g":2,"f":3}`, `{"name":"",` + zero + `,"f":3,"g":2}`},
		{"escaped names", `{"n\u0061me":"n","f\u00e4":"\"}"}`, `{"name":"n",` + zero + `,"f\u00e4":"\"}"}`},
		{"null", `null`, `{"name":"",` + zero + `}`},
		{"null inner", `{"in":null,"ptr":null,"list":null}`, `{"name":"",` + zero + `}`},
		// Map values are not looked into.
		{"map", `{"Map":{"k":{"a":"x","f":1}}}`, `{"name":"","in":{"a":""},"array":[{"a":""}],"at":"0001-01-01T00:00:00Z","Map":{"k":{"a":"x"}}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var v outer
			require.NoError(t, jsonkeep.Unmarshal([]byte(tc.in), &v))
			var plain outer
			require.NoError(t, json.Unmarshal([]byte(tc.in), &plain))
			out, err := jsonkeep.Marshal(v)
			require.NoError(t, err)
			require.Equal(t, tc.want, string(out))
			again, err := jsonkeep.Marshal(&v)
			require.NoError(t, err)
			require.Equal(t, tc.want, string(again), "a pointer encodes as its value")
			var back outer
			require.NoError(t, json.Unmarshal(out, &back))
			back.Unknown, plain.Unknown = jsonkeep.Unknown{}, jsonkeep.Unknown{}
			std, err := json.Marshal(back)
			require.NoError(t, err)
			want, err := json.Marshal(plain)
			require.NoError(t, err)
			require.Equal(t, string(want), string(std), "the known fields as encoding/json reads them")
		})
	}
}

func TestDecodeReplacesWhatWasKept(t *testing.T) {
	var v outer
	require.NoError(t, jsonkeep.Unmarshal([]byte(`{"f":1,"list":[{"g":2}]}`), &v))
	require.False(t, v.Unknown.Empty())
	require.NoError(t, jsonkeep.Unmarshal([]byte(`{"name":"n","list":[{"a":"x"}]}`), &v))
	require.True(t, v.Unknown.Empty(), "a record decoded again holds what its new JSON has")
	require.True(t, v.List[0].Unknown.Empty())
}

func TestWithoutKeeper(t *testing.T) {
	var v noKeeper
	require.NoError(t, jsonkeep.Unmarshal([]byte(`{"a":"x","f":1}`), &v))
	out, err := jsonkeep.Marshal(v)
	require.NoError(t, err)
	require.Equal(t, `{"a":"x"}`, string(out))
	out, err = jsonkeep.Marshal(nil)
	require.NoError(t, err)
	require.Equal(t, `null`, string(out))
	require.Error(t, jsonkeep.Unmarshal([]byte(`{"a":1}`), &v), "encoding/json's errors")
}

// TestCopiesCarry: a struct copied, and changed, keeps what it held:
// how a rewrite starts from the record read.
func TestCopiesCarry(t *testing.T) {
	var v outer
	require.NoError(t, jsonkeep.Unmarshal([]byte(`{"name":"a","f":{"x":[1,2]}}`), &v))
	w := v
	w.Name = "b"
	out, err := jsonkeep.Marshal(w)
	require.NoError(t, err)
	require.Equal(t, `{"name":"b",`+`"in":{"a":""},"array":[{"a":""}],"at":"0001-01-01T00:00:00Z","Map":null`+`,"f":{"x":[1,2]}}`, string(out))
}

// hiddenOnly keeps nothing: its only Unknown and its nested struct are
// reached through an unexported embedded struct, which reflection does
// not let Unmarshal set.
type hiddenOnly struct {
	hidden
}

type hidden struct {
	In inner `json:"in"`
	jsonkeep.Unknown
}

func TestUnexportedEmbeddedNotLookedInto(t *testing.T) {
	var v hiddenOnly
	require.NoError(t, jsonkeep.Unmarshal([]byte(`{"in":{"a":"x","f":1},"g":2}`), &v))
	out, err := jsonkeep.Marshal(v)
	require.NoError(t, err)
	require.Equal(t, `{"in":{"a":"x"}}`, string(out))
}
