package jsonkeep

import (
	"encoding"
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"
)

// typeInfo is what Unmarshal and Marshal need to know of a type: where
// its Unknowns are, and, for a struct, the member names encoding/json
// decodes into its fields.
type typeInfo struct {
	kind reflect.Kind // Pointer, Slice, Array, Struct; anything else holds nothing
	// holds: a value of the type can hold kept members.
	holds bool
	// elem is a pointer's, a slice's or an array's element.
	elem *typeInfo
	// keeper is the index of a struct's Unknown (the shallowest, through
	// embedded structs, as Go promotes fields); nil if it has none.
	keeper []int
	// exact and folded find a struct's field by member name, as
	// encoding/json does: exactly, else by the folded name.
	exact, folded map[string]*fieldInfo
	// nested are the fields whose values can hold kept members.
	nested []*fieldInfo
}

type fieldInfo struct {
	index []int
	info  *typeInfo
}

// field finds the field encoding/json decodes the member name into.
func (ti *typeInfo) field(name []byte) *fieldInfo {
	if f := ti.exact[string(name)]; f != nil {
		return f
	}
	var buf [32]byte
	return ti.folded[string(appendFolded(buf[:0], name))]
}

var (
	infos       sync.Map // reflect.Type → *typeInfo
	unknownType = reflect.TypeFor[Unknown]()
	opaque      = []reflect.Type{reflect.TypeFor[json.Marshaler](), reflect.TypeFor[json.Unmarshaler](),
		reflect.TypeFor[encoding.TextMarshaler](), reflect.TypeFor[encoding.TextUnmarshaler]()}
)

func infoOf(t reflect.Type) *typeInfo {
	if ti, ok := infos.Load(t); ok {
		return ti.(*typeInfo)
	}
	ti := build(t, map[reflect.Type]*typeInfo{})
	infos.Store(t, ti)
	return ti
}

// build works out t's typeInfo; building holds the ones under way, so
// that a recursive type ends.
func build(t reflect.Type, building map[reflect.Type]*typeInfo) *typeInfo {
	if ti, ok := infos.Load(t); ok {
		return ti.(*typeInfo)
	}
	if ti := building[t]; ti != nil {
		return ti
	}
	ti := &typeInfo{}
	building[t] = ti
	if slices.ContainsFunc(opaque, func(i reflect.Type) bool { return t.Implements(i) || reflect.PointerTo(t).Implements(i) }) {
		return ti // encoded by its own methods: not looked into
	}
	switch t.Kind() {
	case reflect.Pointer, reflect.Slice, reflect.Array:
		ti.kind, ti.elem = t.Kind(), build(t.Elem(), building)
		ti.holds = ti.elem.holds
	case reflect.Struct:
		ti.kind = reflect.Struct
		buildStruct(ti, t, building)
	}
	return ti
}

// buildStruct finds a struct's fields as encoding/json does
// (typeFields): exported fields by their tag's name or their own, the
// fields of embedded structs without a name in the tag as if they were
// the struct's own. Names of one depth that clash are each known, though
// encoding/json ignores both: such a member is dropped, never kept twice.
func buildStruct(ti *typeInfo, t reflect.Type, building map[reflect.Type]*typeInfo) {
	ti.exact, ti.folded = map[string]*fieldInfo{}, map[string]*fieldInfo{}
	type level struct {
		t     reflect.Type
		index []int
		// hidden: reached through an unexported embedded struct, whose
		// fields reflection reads but does not hand out to be set.
		hidden bool
	}
	visited := map[reflect.Type]bool{}
	for current := []level{{t: t}}; len(current) > 0; {
		var next []level
		for _, l := range current {
			if visited[l.t] {
				continue
			}
			visited[l.t] = true
			for i := range l.t.NumField() {
				sf := l.t.Field(i)
				index := append(slices.Clip(l.index), i)
				if sf.Type == unknownType {
					if ti.keeper == nil && sf.IsExported() && !l.hidden {
						ti.keeper = index
					}
					continue
				}
				ft := sf.Type
				if ft.Name() == "" && ft.Kind() == reflect.Pointer {
					ft = ft.Elem()
				}
				if sf.Anonymous {
					if !sf.IsExported() && ft.Kind() != reflect.Struct {
						continue
					}
				} else if !sf.IsExported() {
					continue
				}
				tag := sf.Tag.Get("json")
				if tag == "-" {
					continue
				}
				name, _, _ := strings.Cut(tag, ",")
				if !validTag(name) {
					name = ""
				}
				if name == "" && sf.Anonymous && ft.Kind() == reflect.Struct {
					next = append(next, level{t: ft, index: index, hidden: l.hidden || !sf.IsExported()})
					continue
				}
				if name == "" {
					name = sf.Name
				}
				f := &fieldInfo{index: index, info: &typeInfo{}} // hidden: not looked into
				if !l.hidden {
					f.info = build(sf.Type, building)
				}
				if _, dup := ti.exact[name]; !dup {
					ti.exact[name] = f
				}
				if folded := string(appendFolded(nil, []byte(name))); ti.folded[folded] == nil {
					ti.folded[folded] = f
				}
				if f.info.holds {
					ti.nested = append(ti.nested, f)
				}
			}
		}
		current = next
	}
	ti.holds = ti.keeper != nil || len(ti.nested) > 0
}

// validTag reports whether encoding/json takes s as a member name.
func validTag(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		switch {
		case strings.ContainsRune("!#$%&()*+-./:;<=>?@[]^_{|}~ ", c):
		case !unicode.IsLetter(c) && !unicode.IsDigit(c):
			return false
		}
	}
	return true
}

// appendFolded appends name folded as encoding/json folds member names
// to match them to fields: ASCII in upper case, any other rune the
// smallest of its fold set.
func appendFolded(out, name []byte) []byte {
	for i := 0; i < len(name); {
		if c := name[i]; c < utf8.RuneSelf {
			if 'a' <= c && c <= 'z' {
				c -= 'a' - 'A'
			}
			out = append(out, c)
			i++
			continue
		}
		r, n := utf8.DecodeRune(name[i:])
		for {
			r2 := unicode.SimpleFold(r)
			if r2 <= r {
				r = r2
				break
			}
			r = r2
		}
		out = utf8.AppendRune(out, r)
		i += n
	}
	return out
}
