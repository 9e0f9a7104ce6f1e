package bgp

import (
	"encoding/json"
	"fmt"
	"strconv"
)

// ASN is an autonomous system number as the agent's file gives it: a
// plain number from 1 to 4294967294 that no RFC reserves. It reads itself
// (UnmarshalJSON), so the strict reader (configfile) names the key of a
// bad one, bgp.peers[0].asn, with the reason, instead of a decoder's
// "cannot unmarshal number into uint32".
type ASN uint32

// asnReserved are the numbers no session may use, with the RFC that
// reserves them. 4294967296 and above do not fit in 32 bits.
var asnReserved = []struct {
	lo, hi uint64
	why    string
}{
	{0, 0, "reserved (RFC 7607)"},
	{23456, 23456, "AS_TRANS, which stands in for a 4-octet AS in a 2-octet field (RFC 6793)"},
	{65535, 65535, "reserved (RFC 7300)"},
	{65552, 131071, "reserved by IANA"},
	{4294967295, 4294967295, "reserved (RFC 7300)"},
}

// CheckASN says why v cannot be an AS number of a session, nil if it can.
// The private ranges (64512-65534, 4200000000-4294967294) and the
// documentation ones (64496-64511, 65536-65551) are accepted.
func CheckASN(v uint64) error {
	if v > 4294967295 {
		return fmt.Errorf("%d is not an AS number: at most 4294967294", v)
	}
	for _, r := range asnReserved {
		if v >= r.lo && v <= r.hi {
			return fmt.Errorf("%d is not a usable AS number: %s", v, r.why)
		}
	}
	return nil
}

// UnmarshalJSON reads a plain number and refuses one CheckASN refuses.
func (a *ASN) UnmarshalJSON(b []byte) error {
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("%s is not an AS number: want a number such as 65001", b)
	}
	v, err := strconv.ParseUint(n.String(), 10, 64)
	if err != nil {
		return fmt.Errorf("%s is not an AS number: want a whole number from 1 to 4294967294", n)
	}
	if err := CheckASN(v); err != nil {
		return err
	}
	*a = ASN(v)
	return nil
}
