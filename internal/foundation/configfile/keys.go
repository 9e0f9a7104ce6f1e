package configfile

import (
	"reflect"
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
