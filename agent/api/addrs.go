package api

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"strconv"
)

// Addrs is a request's list of addresses: a JSON array of strings such as
// "10.0.0.5" or "fd00::5". It decodes as []netip.Addr does, except that a
// malformed or empty entry fails with a *json.UnmarshalTypeError whose
// Field ends in the entry's index ("ips.[1]"), so the agent's 400 answer
// can name the entry at fault.
type Addrs []netip.Addr

// Prefixes is a request's list of prefixes, such as "10.0.0.5/32", and
// decodes as Addrs does.
type Prefixes []netip.Prefix

// UnmarshalJSON decodes a list of addresses, naming a bad entry's index.
func (as *Addrs) UnmarshalJSON(data []byte) error {
	out, err := decodeList(data, netip.ParseAddr)
	if err == nil {
		*as = out
	}
	return err
}

// UnmarshalJSON decodes a list of prefixes, naming a bad entry's index.
func (ps *Prefixes) UnmarshalJSON(data []byte) error {
	out, err := decodeList(data, netip.ParsePrefix)
	if err == nil {
		*ps = out
	}
	return err
}

// decodeList decodes a JSON array of strings (or null) with parse. The
// error for a bad entry is a *json.UnmarshalTypeError: encoding/json
// prefixes its Field with the path of the struct field holding the list.
func decodeList[T any](data []byte, parse func(string) (T, error)) ([]T, error) {
	var texts []string
	if err := json.Unmarshal(data, &texts); err != nil {
		return nil, err
	}
	if texts == nil {
		return nil, nil
	}
	out := make([]T, len(texts))
	for i, s := range texts {
		v, err := parse(s)
		if err != nil {
			return nil, &json.UnmarshalTypeError{Value: "string " + strconv.Quote(s), Type: reflect.TypeFor[T](), Field: "[" + strconv.Itoa(i) + "]"}
		}
		out[i] = v
	}
	return out, nil
}
