package configfile

import (
	"reflect"
	"strings"
)

// Key is one key a configuration type accepts.
type Key struct {
	// Path is the key's dotted path; a list's element is written "[]":
	// etcd.endpoints, pools[].reserved[].range.
	Path string
	// Type is the field's Go type.
	Type reflect.Type
	// Section is true for a struct, or a list of structs, whose own keys
	// follow it.
	Section bool
}

// Keys lists every key of the struct type t, depth first in field order:
// each section, then its keys. A map (such as labels) is one key, its
// keys free; a self-decoding type (Duration, an address) is one key.
// It is what a reference table of the file must name.
func Keys(t reflect.Type) []Key {
	return keysUnder(deref(t), "")
}

func keysUnder(t reflect.Type, prefix string) []Key {
	var out []Key
	for _, f := range fields(t) {
		path := join(prefix, f.name)
		inner, suffix := deref(f.typ), ""
		for (inner.Kind() == reflect.Slice || inner.Kind() == reflect.Array) && !selfDecoding(inner) {
			inner, suffix = deref(inner.Elem()), suffix+"[]"
		}
		section := inner.Kind() == reflect.Struct && !selfDecoding(inner)
		out = append(out, Key{Path: path, Type: f.typ, Section: section})
		if section {
			out = append(out, keysUnder(inner, path+suffix)...)
		}
	}
	return out
}

// normalize is how near two keys are spelt apart from case and the
// separators of flag and environment names (lease-ttl, LEASE_TTL).
func normalize(k string) string {
	return strings.ToLower(strings.NewReplacer("-", "", "_", "").Replace(k))
}

// closest is the name in names that k was probably meant to be: the
// same but for case or separators, else within a small edit distance
// (one edit in five letters, at least one); "" if none is.
func closest(k string, names []string) string {
	best, bestD := "", -1
	nk := normalize(k)
	for _, n := range names {
		d := editDistance(nk, normalize(n))
		if d <= 1+len(nk)/5 && (bestD < 0 || d < bestD) {
			best, bestD = n, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
