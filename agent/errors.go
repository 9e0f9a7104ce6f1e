package agent

import "errors"

// Errors of the agent's domain code. The HTTP adapter (server.go) alone
// maps them, and the allocator's, to statuses and API codes. Compare with
// errors.Is.
var (
	// ErrBadRequest is a request the agent refuses as given.
	ErrBadRequest = errors.New("agent: bad request")
	// ErrNotFound is a request about something the agent does not have.
	ErrNotFound = errors.New("agent: not found")
	// ErrNotReady is a request the agent cannot serve yet (restoring, no
	// lease, etcd unreachable): try again.
	ErrNotReady = errors.New("agent: not ready")
	// ErrBadConfig is a configuration the agent cannot run with, found
	// only at start (it depends on the host, as the overlay's MTU does).
	ErrBadConfig = errors.New("agent: bad configuration")
)

// FieldError is a refused request field, named by its JSON path. It wraps
// ErrBadRequest.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Msg }

// Unwrap makes a FieldError an ErrBadRequest.
func (e *FieldError) Unwrap() error { return ErrBadRequest }
