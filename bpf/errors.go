//go:build linux

package bpf

import "errors"

var (
	// ErrClosed is returned by every method of a [Datapath] after Close.
	ErrClosed = errors.New("bpf: datapath closed")
	// ErrInvalidEndpoint is returned for an [Endpoint] that cannot be
	// attached as given.
	ErrInvalidEndpoint = errors.New("bpf: invalid endpoint")
	// ErrAddressInUse is returned by Attach when an address already belongs
	// to another host interface. IPAM never hands one address to two
	// owners, so this means a stale endpoint the agent has to Detach first.
	ErrAddressInUse = errors.New("bpf: address in use by another endpoint")
)

// ErrInterfaceExists is returned by Forget while the endpoint's interface
// still exists: detaching then would let its frames through unchecked.
var ErrInterfaceExists = errors.New("bpf: interface still exists")

// ErrReaderOpen is returned by Announcements while another reader of the
// announcement ring buffer is open.
var ErrReaderOpen = errors.New("bpf: announcement reader already open")
