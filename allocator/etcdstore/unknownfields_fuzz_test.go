package etcdstore

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

// recordKind is one kind of value kvipam writes under Prefix, with a
// sample as a newer version might write it: every member this version
// knows, and members it does not at every depth.
type recordKind struct {
	name   string
	sample string
	check  func(t *testing.T, data []byte)
}

func kindOf[T any](name, sample string) recordKind {
	return recordKind{name: name, sample: sample, check: checkRoundTrip[T]}
}

// recordKinds are the values of every key of docs/etcd-schema.md.
func recordKinds() []recordKind {
	const at = `"2026-11-22T07:52:21Z"`
	owner := `"containerID":"c0ffee","ifName":"eth0","namespace":"web","pod":"web-0","podUID":"5f0c","network":"kvipam"`
	return []recordKind{
		kindOf[allocator.Pool]("pool spec", `{"name":"default","cidrs":["10.244.0.0/16","fd00:244::/64"],"blockSizeV4":26,"blockSizeV6":120,
			"reserved":[{"range":"10.244.0.1-10.244.0.9","reason":"routers","f":{"x":[1,2]}}],"disabled":true,"draining":["10.244.0.0/16"],
			"nodeSelector":"rack=r1","reuseCooldown":"2m10s","masquerade":false,"maxBlocksPerNode":4,"fromTheFuture":{"x":[1,2]}}`),
		kindOf[DeletedPool]("deleted-pool mark", `{"name":"old","deletedAt":`+at+`,"f":1}`),
		kindOf[SchemaSetting]("schema setting", `{"level":2,"downgrade":true,"by":"kvipamctl","version":"v0.2.0","at":`+at+`,"f":{}}`),
		kindOf[historySettingJSON]("history setting", `{"retention":"168h0m0s","node":"node-a","at":`+at+`,"f":[]}`),
		kindOf[NodeRecord]("node record", `{"name":"node-a","bootID":"3f0c","version":"v0.1.0","addresses":["192.0.2.10"],"labels":{"rack":"r1"},
			"startedAt":`+at+`,"lease":7587883614937301512,"features":["pool-max-blocks"],
			"lostEndpoints":[{"owner":"c0ffee/eth0","namespace":"web","pod":"web-0","kept":true,"foundAt":`+at+`,"reason":"r","f":1,
			"ips":[{"ip":"10.244.0.70","pool":"default","heldBy":"beef/eth0","heldByNode":"node-b","unknown":true,"f":{"y":null}}]}]}`),
		kindOf[records.Claim]("claim, borrower fence", `{"node":"node-a","bootID":"3f0c","claimedAt":`+at+`,"f":"s"}`),
		kindOf[records.Home]("block home, lent home", `{"node":"node-a","since":`+at+`,"f":true}`),
		kindOf[records.Record]("ip record", `{`+owner+`,"node":"node-a","state":"kept","since":`+at+`,"borrowed":true,"identity":"db/pg-0","windowSeconds":600,"f":{"x":1}}`),
		kindOf[records.Binding]("sticky binding", `{"identity":"db/pg-0","addrs":["10.244.0.70"],"owner":{`+owner+`,"f":2},"node":"node-a","since":`+at+`,"windowSeconds":600,"f":3}`),
		kindOf[NamespaceBinding]("namespace binding", `{"pool":"blue","since":`+at+`,"f":4}`),
		kindOf[HistoryRecord]("ip history entry", `{"pool":"default","ip":"10.244.0.70",`+owner+`,"node":"node-a","start":`+at+`,"end":`+at+`,"reason":"released","f":5}`),
	}
}

// FuzzUnknownFields: every record kind, decoded from any JSON and
// encoded again (as a rewrite does), keeps every member it does not know,
// at every depth, byte for byte, and every field it knows as
// encoding/json reads it.
func FuzzUnknownFields(f *testing.F) {
	kinds := recordKinds()
	for i, k := range kinds {
		f.Add(uint8(i), []byte(k.sample))
	}
	f.Fuzz(func(t *testing.T, kind uint8, data []byte) {
		kinds[int(kind)%len(kinds)].check(t, data)
	})
}

// TestRecordKindsRoundTrip runs the fuzz target's check on the samples,
// so that a plain go test runs it too.
func TestRecordKindsRoundTrip(t *testing.T) {
	for _, k := range recordKinds() {
		t.Run(k.name, func(t *testing.T) {
			require.True(t, json.Valid([]byte(k.sample)))
			k.check(t, []byte(k.sample))
		})
	}
}

func checkRoundTrip[T any](t *testing.T, data []byte) {
	var plain T
	if json.Unmarshal(data, &plain) != nil || foldedTwice(data) {
		return // not a record; or names one member twice, in two cases
	}
	if std, err := json.Marshal(plain); err != nil || json.Unmarshal(std, new(T)) != nil {
		// encoding/json does not read back what it wrote of the known
		// fields (a reserved range without its "range" is written as
		// "invalid IP"): nothing jsonkeep could keep.
		return
	}
	var kept T
	require.NoError(t, jsonkeep.Unmarshal(data, &kept))
	out, err := jsonkeep.Marshal(kept)
	require.NoError(t, err)
	require.True(t, json.Valid(out), "%s", out)
	// Every known field, as encoding/json reads it.
	var back T
	require.NoError(t, json.Unmarshal(out, &back), "%s", out)
	want, err := json.Marshal(plain)
	require.NoError(t, err)
	got, err := json.Marshal(back)
	require.NoError(t, err)
	require.Equal(t, string(want), string(got), "known fields of %s re-encoded as %s", data, out)
	// Every unknown member.
	requireKept[T](t, nil, data, out)
}

// requireKept requires every member of in (JSON a T was decoded from)
// that no field of T takes to be in out (its encoding) as it was in in,
// at every depth.
func requireKept[T any](t *testing.T, path []any, in, out []byte) {
	switch firstByte(in) {
	case '{':
		outs := objectMembers(t, out)
		for _, m := range objectMembers(t, in) {
			if known[T](path, m.name) {
				for _, o := range outs {
					if strings.EqualFold(o.name, m.name) {
						requireKept[T](t, append(path[:len(path):len(path)], m.name), m.value, o.value)
					}
				}
				continue
			}
			var found bool
			for _, o := range outs {
				if o.name == m.name {
					found = true
					var c bytes.Buffer
					require.NoError(t, json.Compact(&c, m.value))
					require.Equal(t, c.String(), string(o.value), "member %q at %v", m.name, path)
				}
			}
			require.True(t, found, "member %q at %v of %s is lost in %s", m.name, path, in, out)
		}
	case '[':
		var ins, outs []json.RawMessage
		require.NoError(t, json.Unmarshal(in, &ins))
		if json.Unmarshal(out, &outs) != nil || len(ins) != len(outs) {
			return // not a slice of T's
		}
		for i := range ins {
			requireKept[T](t, append(path[:len(path):len(path)], i), ins[i], outs[i])
		}
	}
}

// known reports whether encoding/json decodes a member name, at path, into
// a field of T: whether a value there changes what it decodes, or fails
// to decode. It asks encoding/json, not jsonkeep.
func known[T any](path []any, name string) bool {
	decode := func(doc any) (string, bool) {
		b, err := json.Marshal(doc)
		if err != nil {
			return "", false
		}
		var v T
		if json.Unmarshal(b, &v) != nil {
			return "", false
		}
		out, err := json.Marshal(v)
		return string(out), err == nil
	}
	base, _ := decode(nest(path, map[string]any{}))
	for _, probe := range []any{"x", 1, true, map[string]any{}, []any{}} {
		if got, ok := decode(nest(path, map[string]any{name: probe})); !ok || got != base {
			return true
		}
	}
	return false
}

// nest puts leaf at path: member names and array indexes.
func nest(path []any, leaf any) any {
	for i := len(path) - 1; i >= 0; i-- {
		switch p := path[i].(type) {
		case string:
			leaf = map[string]any{p: leaf}
		case int:
			leaf = []any{leaf}
		}
	}
	return leaf
}

type jsonMember struct {
	name  string
	value json.RawMessage
}

// objectMembers lists an object's members in order, the later of two of
// one name only.
func objectMembers(t *testing.T, obj []byte) []jsonMember {
	dec := json.NewDecoder(bytes.NewReader(obj))
	_, err := dec.Token()
	require.NoError(t, err)
	var out []jsonMember
	for dec.More() {
		tok, err := dec.Token()
		require.NoError(t, err)
		var v json.RawMessage
		require.NoError(t, dec.Decode(&v))
		name := tok.(string)
		out = removeName(out, name)
		out = append(out, jsonMember{name: name, value: v})
	}
	return out
}

func removeName(ms []jsonMember, name string) []jsonMember {
	for i, m := range ms {
		if m.name == name {
			return append(ms[:i:i], ms[i+1:]...)
		}
	}
	return ms
}

// foldedTwice reports whether an object in data has two members whose
// names differ only in case: encoding/json merges both into one field.
func foldedTwice(data []byte) bool {
	var walk func(v json.RawMessage) bool
	walk = func(v json.RawMessage) bool {
		switch firstByte(v) {
		case '{':
			dec := json.NewDecoder(bytes.NewReader(v))
			if _, err := dec.Token(); err != nil {
				return false
			}
			var names []string
			for dec.More() {
				tok, err := dec.Token()
				if err != nil {
					return false
				}
				name, _ := tok.(string)
				for _, n := range names {
					if n != name && strings.EqualFold(n, name) {
						return true
					}
				}
				names = append(names, name)
				var m json.RawMessage
				if dec.Decode(&m) != nil {
					return false
				}
				if walk(m) {
					return true
				}
			}
		case '[':
			var els []json.RawMessage
			if json.Unmarshal(v, &els) == nil {
				for _, el := range els {
					if walk(el) {
						return true
					}
				}
			}
		}
		return false
	}
	return walk(data)
}

func firstByte(b []byte) byte {
	b = bytes.TrimLeft(b, " \t\r\n")
	if len(b) == 0 {
		return 0
	}
	return b[0]
}

// BenchmarkRecordCodec: the cost of keeping unknown members on the IP
// record, written at every ADD, against encoding/json alone.
func BenchmarkRecordCodec(b *testing.B) {
	rec := records.Record{Owner: records.Owner{ContainerID: "c0ffee0123456789", IfName: "eth0", Namespace: "web", Pod: "web-0", PodUID: "5f0c9a3e", Network: "kvipam"},
		Node: "node-a", State: records.StateAllocated, Since: time.Date(2026, 11, 22, 7, 52, 21, 0, time.UTC)}
	plain, err := json.Marshal(rec)
	require.NoError(b, err)
	future := append(plain[:len(plain)-1:len(plain)-1], `,"fromTheFuture":{"x":[1,2]}}`...)
	var withUnknown records.Record
	require.NoError(b, jsonkeep.Unmarshal(future, &withUnknown))
	b.Run("encode/json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = json.Marshal(rec)
		}
	})
	b.Run("encode/jsonkeep", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = jsonkeep.Marshal(rec)
		}
	})
	b.Run("encode/jsonkeep-unknown", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = jsonkeep.Marshal(withUnknown)
		}
	})
	for _, c := range []struct {
		name string
		data []byte
		dec  func([]byte, any) error
	}{{"decode/json", plain, json.Unmarshal}, {"decode/jsonkeep", plain, jsonkeep.Unmarshal}, {"decode/jsonkeep-unknown", future, jsonkeep.Unmarshal}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				var r records.Record
				_ = c.dec(c.data, &r)
			}
		})
	}
}
