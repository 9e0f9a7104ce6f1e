package jsonkeep

import (
	"encoding/json"
	"iter"
	"unicode/utf8"
)

// A small reader of JSON that json.Unmarshal or json.Marshal has just
// read or written, so valid: it splits an object into members and an
// array into elements without decoding them, and allocates nothing.

// member is one member of an object as written.
type member struct {
	rawName []byte // the quoted name
	value   []byte
}

// name is the member's name unquoted, as encoding/json reads it.
func (m member) name() []byte {
	inner := m.rawName[1 : len(m.rawName)-1]
	for _, c := range inner {
		if c == '\\' || c >= utf8.RuneSelf {
			var s string
			if json.Unmarshal(m.rawName, &s) != nil {
				return inner // not reached: the name was decoded
			}
			return []byte(s)
		}
	}
	return inner
}

// isObject reports whether data holds an object (and not null).
func isObject(data []byte) bool {
	i := skipSpace(data, 0)
	return i < len(data) && data[i] == '{'
}

// members yields the members of the object data; nothing for null.
func members(data []byte) iter.Seq[member] {
	return func(yield func(member) bool) {
		i := skipSpace(data, 0)
		if i >= len(data) || data[i] != '{' {
			return
		}
		i = skipSpace(data, i+1)
		for i < len(data) && data[i] == '"' {
			nameEnd := skipString(data, i)
			start := skipSpace(data, skipSpace(data, nameEnd)+1) // past ':'
			end := skipValue(data, start)
			if !yield(member{rawName: data[i:nameEnd], value: data[start:end]}) {
				return
			}
			i = skipSpace(data, end)
			if i < len(data) && data[i] == ',' {
				i = skipSpace(data, i+1)
			}
		}
	}
}

// elements yields the elements of the array data; nothing for null.
func elements(data []byte) iter.Seq[[]byte] {
	return func(yield func([]byte) bool) {
		i := skipSpace(data, 0)
		if i >= len(data) || data[i] != '[' {
			return
		}
		i = skipSpace(data, i+1)
		for i < len(data) && data[i] != ']' {
			end := skipValue(data, i)
			if !yield(data[i:end]) {
				return
			}
			i = skipSpace(data, end)
			if i < len(data) && data[i] == ',' {
				i = skipSpace(data, i+1)
			}
		}
	}
}

func skipSpace(data []byte, i int) int {
	for i < len(data) && (data[i] == ' ' || data[i] == '\t' || data[i] == '\n' || data[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index just past the string that starts at i.
func skipString(data []byte, i int) int {
	for i++; i < len(data); i++ {
		switch data[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return i
}

// skipValue returns the index just past the value that starts at i.
func skipValue(data []byte, i int) int {
	if i >= len(data) {
		return i
	}
	switch data[i] {
	case '"':
		return skipString(data, i)
	case '{', '[':
		depth := 0
		for i < len(data) {
			switch data[i] {
			case '"':
				i = skipString(data, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	}
	// A number, true, false or null.
	for i < len(data) {
		switch data[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
		i++
	}
	return i
}
