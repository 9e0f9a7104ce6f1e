package cni

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
)

// specKeys are the keys of a plugin's configuration that the CNI spec
// (1.1.0) defines or lets a runtime add: kvipam accepts them whether it
// reads them or not. Keys under the spec's own "cni.dev/" prefix are
// accepted too, so a later spec's additions do not break a plugin.
var specKeys = []string{"cniVersion", "name", "type", "capabilities", "args", "ipMasq", "ipam", "dns", "prevResult", "runtimeConfig"}

// pluginKeys and ipamKeys are the keys kvipam owns: of the kvipam
// plugin's configuration, and of kvipam-ipam's "ipam" object (the rest of
// that configuration belongs to the main plugin). They are read from the
// structs the parsers decode into, so a new setting cannot be forgotten.
var (
	pluginKeys = append(jsonKeys(reflect.TypeFor[pluginConf]()), specKeys...)
	ipamKeys   = jsonKeys(ipamField.Type)
)

var ipamField, _ = reflect.TypeFor[ipamConf]().FieldByName("IPAM")

// checkKeys refuses a key of obj that is not in known (nor a "cni.dev/"
// key), naming the nearest known key when one is close. The CNI spec lets
// a plugin refuse unknown keys, and a typo (pool) would otherwise fall
// back to a default in silence. where prefixes the message ("ipam: ").
func checkKeys(obj map[string]json.RawMessage, known []string, where string) error {
	var unknown []string
	for k := range obj {
		if !slices.Contains(known, k) && !strings.HasPrefix(k, "cni.dev/") {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	slices.Sort(unknown) // the same message for the same configuration
	k := unknown[0]
	if near := nearestKey(k, known); near != "" {
		return invalidConf("%sunknown key %q: did you mean %q?", where, k, near)
	}
	return invalidConf("%sunknown key %q (known: %s)", where, k, strings.Join(known, ", "))
}

// nearestKey is the known key closest to k by edit distance, ignoring
// case, or "" when none is close enough to be the key k misspells: at
// most a third of k's letters differ (and always at least one may).
func nearestKey(k string, known []string) string {
	best, bestDist := "", max(1, len(k)/3)+1
	for _, c := range known {
		if d := levenshtein(strings.ToLower(k), strings.ToLower(c)); d < bestDist {
			best, bestDist = c, d
		}
	}
	return best
}

// levenshtein is the edit distance between a and b (insertions,
// deletions and substitutions of bytes).
func levenshtein(a, b string) int {
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

// jsonKeys lists the JSON keys of struct type t, with those of its
// embedded structs.
func jsonKeys(t reflect.Type) []string {
	var keys []string
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "-":
		case f.Anonymous && name == "":
			keys = append(keys, jsonKeys(f.Type)...)
		case name != "":
			keys = append(keys, name)
		}
	}
	return keys
}
