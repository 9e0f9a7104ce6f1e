package bgp

import "fmt"

// notificationCodes are the NOTIFICATION error codes and subcodes by the
// names the RFCs give them (RFC 4271 section 4.5, RFC 4486 and RFC 9234
// for Cease and OPEN, RFC 6608 for FSM errors), so that a reason reads as
// the router's log does ("OPEN Message Error / Bad Peer AS").
var notificationCodes = map[uint8]struct {
	name string
	sub  map[uint8]string
}{
	1: {"Message Header Error", map[uint8]string{1: "Connection Not Synchronized", 2: "Bad Message Length", 3: "Bad Message Type"}},
	2: {"OPEN Message Error", map[uint8]string{1: "Unsupported Version Number", 2: "Bad Peer AS", 3: "Bad BGP Identifier",
		4: "Unsupported Optional Parameter", 6: "Unacceptable Hold Time", 7: "Unsupported Capability", 11: "Role Mismatch"}},
	3: {"UPDATE Message Error", map[uint8]string{1: "Malformed Attribute List", 2: "Unrecognized Well-known Attribute",
		3: "Missing Well-known Attribute", 4: "Attribute Flags Error", 5: "Attribute Length Error", 6: "Invalid ORIGIN Attribute",
		8: "Invalid NEXT_HOP Attribute", 9: "Optional Attribute Error", 10: "Invalid Network Field", 11: "Malformed AS_PATH"}},
	4: {"Hold Timer Expired", nil},
	5: {"Finite State Machine Error", map[uint8]string{1: "Unexpected Message in OpenSent", 2: "Unexpected Message in OpenConfirm",
		3: "Unexpected Message in Established"}},
	6: {"Cease", map[uint8]string{1: "Maximum Number of Prefixes Reached", 2: "Administrative Shutdown", 3: "Peer De-configured",
		4: "Administrative Reset", 5: "Connection Rejected", 6: "Other Configuration Change", 7: "Connection Collision Resolution",
		8: "Out of Resources", 9: "Hard Reset", 10: "BFD Down"}},
	7: {"ROUTE-REFRESH Message Error", map[uint8]string{1: "Invalid Message Length"}},
}

// notificationName is "Code / Subcode" by the RFCs' names; a number
// where they have none.
func notificationName(code, subcode uint8) string {
	c, ok := notificationCodes[code]
	if !ok {
		return fmt.Sprintf("error code %d / subcode %d", code, subcode)
	}
	if subcode == 0 {
		return c.name
	}
	if s, ok := c.sub[subcode]; ok {
		return c.name + " / " + s
	}
	return fmt.Sprintf("%s / subcode %d", c.name, subcode)
}
