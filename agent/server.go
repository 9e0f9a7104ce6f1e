package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
)

// routes is the API's mux. Every handler answers JSON; errors are api.Error.
func (a *Agent) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+api.PathHealth, a.handleHealth)
	mux.HandleFunc("GET "+api.PathStatus, a.handleStatus)
	mux.HandleFunc("GET "+api.PathConfig, a.handleConfig)
	mux.HandleFunc("POST "+api.PathAllocate, a.handleAllocate)
	mux.HandleFunc("POST "+api.PathRelease, a.handleRelease)
	mux.HandleFunc("POST "+api.PathEndpoints, a.handleEndpointCreate)
	mux.HandleFunc("GET "+api.PathEndpoints, a.handleEndpointList)
	mux.HandleFunc("DELETE "+api.PathEndpoints, a.handleEndpointDelete)
	mux.HandleFunc("POST "+api.PathGC, a.handleGC)
	mux.HandleFunc("GET "+api.PathAllocations, a.handleAllocations)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		a.writeError(w, r, &api.Error{Status: http.StatusNotFound, Code: api.CodeNotFound, Message: fmt.Sprintf("no such endpoint %s %s", r.Method, r.URL.Path)})
	})
	return mux
}

func (a *Agent) writeJSON(w http.ResponseWriter, r *http.Request, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
	a.m.requests.WithLabelValues(r.URL.Path, strconv.Itoa(status)).Inc()
}

func (a *Agent) writeError(w http.ResponseWriter, r *http.Request, e *api.Error) {
	if e.Status >= 500 {
		a.log.Warn("request failed", "path", r.URL.Path, "code", e.Code, "error", e.Message)
	} else {
		a.log.Debug("request refused", "path", r.URL.Path, "code", e.Code, "error", e.Message, "field", e.Field)
	}
	a.writeJSON(w, r, e.Status, e)
}

// decode reads a size-limited JSON body into v, refusing unknown fields,
// and names the offending field in its error.
func decode(w http.ResponseWriter, r *http.Request, v any) *api.Error {
	body := http.MaxBytesReader(w, r.Body, api.MaxBodyBytes)
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	if err == nil {
		if dec.More() {
			return badField("", "request body holds more than one JSON value")
		}
		return nil
	}
	var mbe *http.MaxBytesError
	var ute *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &mbe):
		return &api.Error{Status: http.StatusRequestEntityTooLarge, Code: api.CodeTooLarge, Message: fmt.Sprintf("request body over %d bytes", mbe.Limit)}
	case errors.As(err, &ute):
		// encoding/json joins the path with dots; a list entry that
		// names its index (api.Addrs) reads ips[0], not ips.[0].
		field := strings.ReplaceAll(ute.Field, ".[", "[")
		return badField(field, fmt.Sprintf("field %s: want %s, got %s", field, ute.Type, ute.Value))
	case errors.As(err, &se):
		return badField("", fmt.Sprintf("malformed JSON at byte %d: %v", se.Offset, err))
	case errors.Is(err, io.EOF):
		return badField("", "empty request body")
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		f := strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)
		return badField(f, "unknown field "+f)
	default:
		return badField("", "bad request body: "+err.Error())
	}
}

func badField(field, msg string) *api.Error {
	return &api.Error{Status: http.StatusBadRequest, Code: api.CodeBadRequest, Message: msg, Field: field}
}

func tryAgain(err error) *api.Error {
	return &api.Error{Status: http.StatusServiceUnavailable, Code: api.CodeTryAgain, Message: err.Error()}
}

// apiError maps an allocator or etcd error to an API error.
func apiError(err error) *api.Error {
	var ee *allocator.ExhaustedError
	switch {
	case errors.As(err, &ee):
		return &api.Error{Status: http.StatusConflict, Code: api.CodeExhausted, Message: ee.Error()}
	case errors.Is(err, allocator.ErrBadRequest):
		return badField("", err.Error())
	case errors.Is(err, allocator.ErrPoolNotFound):
		return badField("pool", err.Error())
	case errors.Is(err, allocator.ErrIPInUse), errors.Is(err, allocator.ErrNotOwned):
		return &api.Error{Status: http.StatusConflict, Code: api.CodeInUse, Message: err.Error()}
	case errors.Is(err, allocator.ErrNotFound), errors.Is(err, allocator.ErrReservationGone):
		return &api.Error{Status: http.StatusNotFound, Code: api.CodeNotFound, Message: err.Error()}
	case errors.Is(err, allocator.ErrLeaseLost), errors.Is(err, allocator.ErrConflict),
		errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled), isUnavailable(err):
		return tryAgain(err)
	default:
		return &api.Error{Status: http.StatusInternalServerError, Code: api.CodeInternal, Message: err.Error()}
	}
}

func isUnavailable(err error) bool {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if s, ok := status.FromError(e); ok {
			switch s.Code() {
			case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Aborted:
				return true
			}
		}
	}
	return false
}

// validOwner checks the fields that identify an attachment.
func validOwner(o api.Owner) *api.Error {
	switch {
	case o.ContainerID == "":
		return badField("owner.containerID", "owner.containerID is empty")
	case len(o.ContainerID) > 256:
		return badField("owner.containerID", "owner.containerID is longer than 256 characters")
	case o.IfName == "":
		return badField("owner.ifName", "owner.ifName is empty")
	case len(o.IfName) > 15 || strings.ContainsAny(o.IfName, "/ \t\n:"):
		return badField("owner.ifName", fmt.Sprintf("owner.ifName %q is not a valid interface name", o.IfName))
	}
	return nil
}

func (a *Agent) requestContext(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), a.cfg.RequestTimeout.Duration)
}
