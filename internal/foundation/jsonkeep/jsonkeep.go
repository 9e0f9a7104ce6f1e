// Package jsonkeep keeps the members of a JSON object that the Go struct
// it is decoded into does not know, and writes them back when the struct
// is encoded. kvipam's records in etcd are JSON written by one version
// and read, and rewritten, by others (a rolling upgrade, a rollback): a
// version that rewrites a record must not drop a field a newer one
// added (docs/etcd-schema.md, "Fields a version does not know").
//
// A struct takes part by embedding Unknown (or by an exported field of
// that type, when the name Unknown is taken). Unmarshal decodes as
// encoding/json does and puts the members no field takes into the
// struct's Unknown; Marshal encodes as encoding/json does and appends
// them after the struct's own. Nested structs (a field, a pointer, the
// elements of a slice or an array) keep theirs in their own Unknown;
// the values of a map, types with their own JSON or text methods, and
// what an unexported embedded struct holds are not looked into. A member is known when encoding/json would decode
// it into a field: by the field's name, exactly or in another case. A
// kept member therefore never shares a name with a field, and cannot
// override one.
package jsonkeep

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
)

// Unknown holds the members of a JSON object that the struct embedding
// it does not know, as read: compact, in the order read (of two members
// of one name, the later). The zero value holds none. It is comparable
// and cheap to copy, and a copy of the struct carries it: a record
// rebuilt from a copy of the one read keeps what it did not know.
type Unknown struct {
	members string // `"name":value,"name":value`
}

// Empty reports whether u holds no member.
func (u Unknown) Empty() bool { return u.members == "" }

// Unmarshal decodes data into v as json.Unmarshal does, and keeps the
// members no field takes in the Unknown of the struct they belong to.
func Unmarshal(data []byte, v any) error {
	if err := json.Unmarshal(data, v); err != nil {
		return err
	}
	rv := reflect.ValueOf(v)
	if ti := infoOf(rv.Type()); ti.holds {
		keep(data, rv, ti)
	}
	return nil
}

// Marshal encodes v as json.Marshal does, with the members each struct's
// Unknown holds after its own fields. A value that holds none is encoded
// by json.Marshal alone.
func Marshal(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	rv := reflect.ValueOf(v)
	if !rv.IsValid() {
		return b, nil
	}
	ti := infoOf(rv.Type())
	if !ti.holds || !carries(rv, ti) {
		return b, nil
	}
	var out bytes.Buffer
	splice(&out, b, rv, ti)
	return out.Bytes(), nil
}

// keep fills the Unknowns under v (addressable, or a pointer) from data,
// the valid JSON v was just decoded from.
func keep(data []byte, v reflect.Value, ti *typeInfo) {
	switch ti.kind {
	case reflect.Pointer:
		if !v.IsNil() {
			keep(data, v.Elem(), ti.elem)
		}
	case reflect.Slice, reflect.Array:
		i := 0
		for el := range elements(data) {
			if i >= v.Len() {
				return
			}
			keep(el, v.Index(i), ti.elem)
			i++
		}
	case reflect.Struct:
		if !isObject(data) {
			return // null: json.Unmarshal left v as it was
		}
		var unknown []member
		for m := range members(data) {
			f := ti.field(m.name())
			switch {
			case f == nil && ti.keeper != nil:
				unknown = setMember(unknown, m)
			case f != nil && f.info.holds:
				if fv, err := fieldOf(v, f.index); err == nil {
					keep(m.value, fv, f.info)
				}
			}
		}
		if kv, err := fieldOf(v, ti.keeper); err == nil {
			kv.Addr().Interface().(*Unknown).members = join(unknown)
		}
	}
}

// carries reports whether an Unknown under v holds a member.
func carries(v reflect.Value, ti *typeInfo) bool {
	switch ti.kind {
	case reflect.Pointer:
		return !v.IsNil() && carries(v.Elem(), ti.elem)
	case reflect.Slice, reflect.Array:
		for i := range v.Len() {
			if carries(v.Index(i), ti.elem) {
				return true
			}
		}
	case reflect.Struct:
		if kv, err := fieldOf(v, ti.keeper); err == nil && kv.Field(0).Len() > 0 {
			return true
		}
		for _, f := range ti.nested {
			if fv, err := fieldOf(v, f.index); err == nil && carries(fv, f.info) {
				return true
			}
		}
	}
	return false
}

// splice writes b, json.Marshal's encoding of v, to out with the members
// v's Unknowns hold put back.
func splice(out *bytes.Buffer, b []byte, v reflect.Value, ti *typeInfo) {
	if !carries(v, ti) {
		out.Write(b)
		return
	}
	switch ti.kind {
	case reflect.Pointer:
		splice(out, b, v.Elem(), ti.elem)
	case reflect.Slice, reflect.Array:
		out.WriteByte('[')
		i := 0
		for el := range elements(b) {
			if i > 0 {
				out.WriteByte(',')
			}
			splice(out, el, v.Index(i), ti.elem)
			i++
		}
		out.WriteByte(']')
	case reflect.Struct:
		out.WriteByte('{')
		n := 0
		for m := range members(b) {
			if n > 0 {
				out.WriteByte(',')
			}
			n++
			out.Write(m.rawName)
			out.WriteByte(':')
			// json.Marshal spells every member as its field's name.
			if f := ti.exact[string(m.name())]; f != nil && f.info.holds {
				if fv, err := fieldOf(v, f.index); err == nil {
					splice(out, m.value, fv, f.info)
					continue
				}
			}
			out.Write(m.value)
		}
		if kv, err := fieldOf(v, ti.keeper); err == nil && kv.Field(0).Len() > 0 {
			if n > 0 {
				out.WriteByte(',')
			}
			out.WriteString(kv.Field(0).String())
		}
		out.WriteByte('}')
	}
}

// setMember adds m to ms, replacing a member of the same name: of two
// members of one name, the later counts, as in encoding/json.
func setMember(ms []member, m member) []member {
	name := m.name()
	for i := range ms {
		if bytes.Equal(ms[i].name(), name) {
			ms[i] = m
			return ms
		}
	}
	return append(ms, m)
}

// join spells ms as Unknown holds them: compact, comma-separated.
func join(ms []member) string {
	if len(ms) == 0 {
		return ""
	}
	var b bytes.Buffer
	for i, m := range ms {
		if i > 0 {
			b.WriteByte(',')
		}
		b.Write(m.rawName)
		b.WriteByte(':')
		if err := json.Compact(&b, m.value); err != nil {
			b.Write(m.value) // not reached: the value was decoded
		}
	}
	return b.String()
}

// fieldOf is v's field at index; an error for no index, or one through
// a nil embedded pointer.
func fieldOf(v reflect.Value, index []int) (reflect.Value, error) {
	if index == nil {
		return reflect.Value{}, errNoField
	}
	return v.FieldByIndexErr(index)
}

var errNoField = errors.New("no field")
