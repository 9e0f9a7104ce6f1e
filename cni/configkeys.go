package cni

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/internal/foundation/suggest"
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
	if near := suggest.Closest(k, known); near != "" {
		return invalidConf("%sunknown key %q: did you mean %q?", where, k, near)
	}
	return invalidConf("%sunknown key %q (known: %s)", where, k, strings.Join(known, ", "))
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
