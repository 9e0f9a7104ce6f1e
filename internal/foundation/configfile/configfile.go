// Package configfile reads a YAML configuration file into a Go struct
// strictly: every key, at every depth, must be the JSON name of a field
// of the struct at that place (sections, lists of sections, sections in
// lists), spelt exactly. An unknown key is an error naming its path
// (etcd.endpoint, pools[0].cidr) and, when a known key is close, the key
// it was probably meant to be: a misspelt setting must never be silently
// ignored (a misspelt etcd.endpoints once gave an agent a private etcd).
//
// A type with its own decoder (UnmarshalJSON, UnmarshalText) is read as a
// single value (a Duration, an address); such a type given a mapping is
// an error, since its decoder would bypass the check: a section is a
// struct of plain fields.
package configfile

import (
	"bytes"
	"cmp"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strconv"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/kvipam/kvipam/internal/foundation/suggest"
)

// Unmarshal decodes the YAML document data into v, a pointer to a
// struct, after checking every key against v's type. It reports every
// unknown key and every value a self-decoding field refuses at once, each
// by its path.
func Unmarshal(data []byte, v any) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("configfile: want a pointer to a struct, got %T", v)
	}
	js, err := yaml.YAMLToJSONStrict(data) // refuses a key given twice
	if err != nil {
		return err
	}
	var tree any
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	if err := dec.Decode(&tree); err != nil {
		return err
	}
	c := checker{root: rv.Elem().Type()}
	c.walk(rv.Elem().Type(), tree, "")
	if len(c.errs) > 0 {
		return errors.Join(c.errs...)
	}
	// sigs.k8s.io/yaml reads a scalar into a string field as a string
	// (node: 123), as the checker's leaves do not; it also refuses any
	// unknown field the walk could not see.
	return yaml.UnmarshalStrict(data, v)
}

type checker struct {
	root reflect.Type
	errs []error
}

func (c *checker) fail(path, format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%s: %s", path, fmt.Sprintf(format, args...)))
}

// walk checks the decoded JSON value v against type t at path.
func (c *checker) walk(t reflect.Type, v any, path string) {
	if v == nil {
		return // null leaves the default
	}
	t = deref(t)
	if selfDecoding(t) {
		if _, ok := v.(map[string]any); ok {
			c.fail(path, "%s decodes itself and cannot be read strictly: a section must be a struct of plain fields", t)
			return
		}
		raw, err := json.Marshal(v)
		if err == nil {
			err = json.Unmarshal(raw, reflect.New(t).Interface())
		}
		if err != nil {
			c.fail(path, "%v", err)
		}
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		m, ok := v.(map[string]any)
		if !ok {
			return // the decoder names the mismatch
		}
		fields := fieldsByName(t)
		for _, k := range sortedKeys(m) {
			p := join(path, k)
			f, ok := fields[k]
			if !ok {
				c.fail(p, "unknown key%s", c.suggest(k, t))
				continue
			}
			c.walk(f, m[k], p)
		}
	case reflect.Slice, reflect.Array:
		l, ok := v.([]any)
		if !ok {
			return
		}
		for i, e := range l {
			c.walk(t.Elem(), e, path+"["+strconv.Itoa(i)+"]")
		}
	case reflect.Map:
		m, ok := v.(map[string]any)
		if !ok {
			return
		}
		for _, k := range sortedKeys(m) {
			c.walk(t.Elem(), m[k], join(path, k))
		}
	}
}

// suggest names the known key closest to k: a sibling, or else a key of
// the same name in another section (by its full path).
func (c *checker) suggest(k string, t reflect.Type) string {
	var names []string
	for _, f := range fields(t) {
		names = append(names, f.name)
	}
	if best := suggest.Closest(k, names); best != "" {
		return " (did you mean " + best + "?)"
	}
	var elsewhere []string
	for _, key := range Keys(c.root) {
		if suggest.Same(lastSegment(key.Path), k) {
			elsewhere = append(elsewhere, key.Path)
		}
	}
	if len(elsewhere) > 0 {
		return " (did you mean " + strings.Join(elsewhere, " or ") + "?)"
	}
	return ""
}

// selfDecoding reports whether t reads itself from JSON or text.
func selfDecoding(t reflect.Type) bool {
	p := reflect.PointerTo(t)
	return p.Implements(reflect.TypeFor[json.Unmarshaler]()) || p.Implements(reflect.TypeFor[encoding.TextUnmarshaler]())
}

// field is one key of a struct: its JSON name and its Go type.
type field struct {
	name string
	typ  reflect.Type
}

// fields are t's keys in field order, with the fields of an untagged
// embedded struct promoted, as encoding/json does.
func fields(t reflect.Type) []field {
	var out []field
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" || (!f.IsExported() && !f.Anonymous) {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if ft := deref(f.Type); f.Anonymous && name == "" && ft.Kind() == reflect.Struct && !selfDecoding(ft) {
			out = append(out, fields(ft)...)
			continue
		}
		out = append(out, field{name: cmp.Or(name, f.Name), typ: f.Type})
	}
	return out
}

func fieldsByName(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for _, f := range fields(t) {
		if _, ok := out[f.name]; !ok {
			out[f.name] = f.typ
		}
	}
	return out
}

func deref(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

func join(path, k string) string {
	if path == "" {
		return k
	}
	return path + "." + k
}

func sortedKeys(m map[string]any) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func lastSegment(path string) string {
	if i := strings.LastIndexAny(path, ".]"); i >= 0 {
		return path[i+1:]
	}
	return path
}
