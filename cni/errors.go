package cni

import (
	"errors"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
)

// Plugin-specific CNI error codes (the spec leaves 100 and up to plugins).
const (
	// ErrCodePoolExhausted: the pool has no free address and no block to
	// claim or borrow. The message is the agent's: the pool's size,
	// allocated, reserved and borrowed addresses, and whether the
	// shortage is temporary.
	ErrCodePoolExhausted uint = 100
	// ErrCodeAddressInUse: a requested static IP belongs to another owner.
	ErrCodeAddressInUse uint = 101
	// ErrCodePoolDisabled: the pool is disabled (being drained) and
	// hands out no new address.
	ErrCodePoolDisabled uint = 102
	// ErrCodeNodeNameTaken: another kvipam agent (another machine, or
	// other node addresses) holds this node's name, so this node's agent
	// serves no new ADDs until it is restarted. It does not pass by
	// itself, so it is not "try again later". The message names both
	// agents.
	ErrCodeNodeNameTaken uint = 103
	// ErrCodePortInUse: a port mapping (same protocol and host port, the
	// same hostIP or either of them every address) is another pod's on
	// the node. The message names that pod.
	ErrCodePortInUse uint = 104
)

// STATUS codes of CNI 1.1.
const (
	// ErrCodeNotAvailable: the plugin cannot serve ADD (agent or etcd
	// down, pool exhausted).
	ErrCodeNotAvailable = types.ErrPluginNotAvailable
)

// codedError is an error that already knows its CNI code.
type codedError struct {
	code uint
	err  error
}

func (e *codedError) Error() string { return e.err.Error() }
func (e *codedError) Unwrap() error { return e.err }

// withCode marks err with a CNI error code; ToCNIError honours it.
func withCode(code uint, err error) error {
	if err == nil {
		return nil
	}
	return &codedError{code: code, err: err}
}

// Code returns the CNI error code for err:
//
//   - a code given with withCode, or a *types.Error's own;
//   - 11 (try again later) when the agent is unreachable, or answers that
//     etcd or its lease is unavailable;
//   - 100 when the pool is exhausted, 101 when a requested IP is in use,
//     102 when the pool is disabled, 103 when another agent holds the
//     node's name;
//   - 7 when the agent refuses the request as bad (it comes from the
//     configuration or CNI_ARGS);
//   - 999 otherwise.
func Code(err error) uint {
	var ce *codedError
	var te *types.Error
	var ae *api.Error
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ce):
		return ce.code
	case errors.As(err, &te):
		return te.Code
	case errors.Is(err, client.ErrUnreachable):
		return types.ErrTryAgainLater
	case errors.As(err, &ae):
		switch ae.Code {
		case api.CodeTryAgain:
			return types.ErrTryAgainLater
		case api.CodeExhausted:
			return ErrCodePoolExhausted
		case api.CodeInUse:
			return ErrCodeAddressInUse
		case api.CodeDisabled:
			return ErrCodePoolDisabled
		case api.CodeNameTaken:
			return ErrCodeNodeNameTaken
		case api.CodePortInUse:
			return ErrCodePortInUse
		case api.CodeBadRequest:
			return types.ErrInvalidNetworkConfig
		}
	}
	return types.ErrInternal
}

// ToCNIError turns err into the CNI error a plugin prints: the code from
// Code and the whole message, which names the operation and the cause.
// A *types.Error passes through unchanged.
func ToCNIError(err error) *types.Error {
	if err == nil {
		return nil
	}
	var te *types.Error
	if errors.As(err, &te) && te.Error() == err.Error() {
		return te
	}
	e := types.NewError(Code(err), err.Error(), "")
	switch e.Code {
	case types.ErrTryAgainLater:
		e.Details = "the kvipam agent is starting or restarting, or cannot reach etcd; retry"
	case ErrCodePoolExhausted:
		e.Details = "the message says whether addresses come free by themselves; otherwise add a cidr (kvipamctl pool add-cidr) or free addresses; see kvipamctl pool show"
	case ErrCodePoolDisabled:
		e.Details = "an operator disabled the pool (kvipamctl pool enable turns it back on); choose another pool"
	case ErrCodePortInUse:
		e.Details = "two pods on the node ask for the same host port: schedule one elsewhere or change its hostPort"
	case ErrCodeNodeNameTaken:
		e.Details = "two kvipam agents run under one node name; node names must be unique: give one a name of its own (kvipam-agent --node), then restart this node's agent (docs/operations.md)"
	}
	return e
}

// result turns a command's error into what skel prints: a *types.Error,
// or a nil error (not a typed nil).
func result(err error) error {
	if err == nil {
		return nil
	}
	return ToCNIError(err)
}
