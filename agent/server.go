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
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/prometheus/client_golang/prometheus"
)

// apiServer is the HTTP adapter of the agent's API, and its only place
// that knows HTTP: every route decodes its request, validates it, checks
// the agent's readiness, bounds the work with a context, calls the domain
// parts, maps their errors to API errors (apiError) and writes JSON. It is
// safe for concurrent use.
type apiServer struct {
	// state says whether the agent can serve everything (readyErr nil),
	// and whether it knows its allocations (enough to release).
	state    readinessState
	timeout  time.Duration
	requests *prometheus.CounterVec
	log      hclog.Logger
	h        *handlers
}

// need is what a route needs of the agent's state.
type need int

const (
	needNothing  need = iota // reads of local state
	needRestored             // releases: the allocations must be known
	needReady                // writes: restored, lease held, etcd reachable
)

// input reads a route's request: a JSON body, the query, or nothing.
type input[Req any] func(w http.ResponseWriter, r *http.Request) (Req, error)

// jsonBody decodes a size-limited JSON body that has no unknown fields.
func jsonBody[Req any](w http.ResponseWriter, r *http.Request) (Req, error) {
	var req Req
	if e := decode(w, r, &req); e != nil {
		return req, e
	}
	return req, nil
}

func noInput(http.ResponseWriter, *http.Request) (struct{}, error) { return struct{}{}, nil }

// ownerQuery reads ?containerID=&ifName=.
func ownerQuery(_ http.ResponseWriter, r *http.Request) (api.Owner, error) {
	o := api.Owner{ContainerID: r.URL.Query().Get("containerID"), IfName: r.URL.Query().Get("ifName")}
	return o, validOwner(o)
}

// route adapts one domain call to HTTP: read and check the request (a 4xx
// names the field), check readiness (503 try-again), call f with the
// request's context bounded by the caller's wait (budget), map its error, write
// the answer with status.
func route[Req, Resp any](s *apiServer, n need, status int, in input[Req], check func(Req) error, f func(ctx context.Context, req Req) (Resp, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		req, err := in(w, r)
		if err == nil && check != nil {
			err = check(req)
		}
		if err != nil {
			s.writeError(w, r, apiError(err))
			return
		}
		if err := s.check(n); err != nil {
			s.writeError(w, r, unready(err))
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), s.budget(r))
		defer cancel()
		resp, err := f(ctx, req)
		if err != nil {
			s.writeError(w, r, apiError(err))
			return
		}
		s.writeJSON(w, r, status, resp)
	}
}

// maxRequestBudget bounds the work of one request whatever its caller
// waits (a plugin's agentTimeout is at most 5 minutes).
const maxRequestBudget = 5 * time.Minute

// budget is how long a request may work: as long as its caller waits
// (api.HeaderTimeout) less a fifth for the answer's way back and the
// work a deadline cannot cut short (at most a second), or the agent's
// request timeout when the caller does not say.
func (s *apiServer) budget(r *http.Request) time.Duration {
	ms, err := strconv.ParseInt(r.Header.Get(api.HeaderTimeout), 10, 64)
	if err != nil || ms <= 0 {
		return s.timeout
	}
	d := min(time.Duration(ms)*time.Millisecond, maxRequestBudget)
	return d - min(d/5, time.Second)
}

func (s *apiServer) check(n need) error {
	switch n {
	case needReady:
		return s.state.readyErr()
	case needRestored:
		if !s.state.isRestored() {
			// Until the node knows its allocations, a release would free
			// nothing and tear down a running pod's datapath for nothing.
			if err := s.state.readyErr(); err != nil {
				return err
			}
			return ErrNotReady
		}
	}
	return nil
}

// routes is the API's mux. Every handler answers JSON; errors are api.Error.
func (s *apiServer) routes() http.Handler {
	h := s.h
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+api.PathHealth, route(s, needReady, http.StatusOK, noInput, nil, h.health))
	mux.HandleFunc("GET "+api.PathStatus, route(s, needNothing, http.StatusOK, noInput, nil, h.status))
	mux.HandleFunc("GET "+api.PathConfig, route(s, needNothing, http.StatusOK, noInput, nil, h.config))
	mux.HandleFunc("POST "+api.PathAllocate, route(s, needReady, http.StatusOK, jsonBody[api.AllocateRequest], h.checkAllocate, h.allocate))
	mux.HandleFunc("POST "+api.PathRelease, route(s, needRestored, http.StatusOK, jsonBody[api.ReleaseRequest], checkRelease, h.release))
	mux.HandleFunc("POST "+api.PathEndpoints, route(s, needReady, http.StatusCreated, jsonBody[api.EndpointRequest], checkEndpoint, h.createEndpoint))
	mux.HandleFunc("GET "+api.PathEndpoints, route(s, needNothing, http.StatusOK, statsQuery, nil, h.listEndpoints))
	mux.HandleFunc("POST "+api.PathGC, route(s, needReady, http.StatusOK, jsonBody[api.GCRequest], h.checkGC, h.gc))
	mux.HandleFunc("GET "+api.PathAllocations, route(s, needNothing, http.StatusOK, ownerQuery, nil, h.allocations))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, &api.Error{Status: http.StatusNotFound, Code: api.CodeNotFound, Message: fmt.Sprintf("no such endpoint %s %s", r.Method, r.URL.Path)})
	})
	return mux
}

func (s *apiServer) writeJSON(w http.ResponseWriter, r *http.Request, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
	s.requests.WithLabelValues(r.URL.Path, strconv.Itoa(status)).Inc()
}

func (s *apiServer) writeError(w http.ResponseWriter, r *http.Request, e *api.Error) {
	if e.Status >= 500 {
		s.log.Warn("request failed", "path", r.URL.Path, "code", e.Code, "error", e.Message)
	} else {
		s.log.Debug("request refused", "path", r.URL.Path, "code", e.Code, "error", e.Message, "field", e.Field)
	}
	s.writeJSON(w, r, e.Status, e)
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

// unready maps why the agent cannot serve a request now: try again,
// unless another agent holds the node's name, which does not pass by
// itself (only a restart of this agent, once the names are fixed, does).
func unready(err error) *api.Error {
	if errors.Is(err, etcdstore.ErrNodeTaken) {
		return &api.Error{Status: http.StatusConflict, Code: api.CodeNameTaken, Message: err.Error()}
	}
	return tryAgain(err)
}

// apiError maps a domain, allocator or etcd error to an API error. It is
// the one place where errors become statuses and API codes.
func apiError(err error) *api.Error {
	var ae *api.Error
	var ee *records.ExhaustedError
	var fe *FieldError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &fe):
		return badField(fe.Field, fe.Msg)
	case errors.Is(err, ErrPortInUse):
		return &api.Error{Status: http.StatusConflict, Code: api.CodePortInUse, Message: err.Error()}
	case errors.Is(err, ErrBadRequest):
		return badField("", err.Error())
	case errors.Is(err, ErrNotFound):
		return &api.Error{Status: http.StatusNotFound, Code: api.CodeNotFound, Message: err.Error()}
	case errors.Is(err, ErrNotReady), errors.Is(err, retry.ErrUnavailable):
		return tryAgain(err)
	case errors.As(err, &ee):
		return &api.Error{Status: http.StatusConflict, Code: api.CodeExhausted, Message: ee.Error()}
	case errors.Is(err, records.ErrPoolDisabled):
		return &api.Error{Status: http.StatusConflict, Code: api.CodeDisabled, Message: err.Error()}
	case errors.Is(err, records.ErrBadRequest):
		return badField("", err.Error())
	case errors.Is(err, records.ErrPoolNotFound), errors.Is(err, records.ErrNodeNotSelected):
		return badField("pool", err.Error())
	case errors.Is(err, records.ErrIPInUse), errors.Is(err, records.ErrNotOwned), errors.Is(err, records.ErrIdentityInUse):
		return &api.Error{Status: http.StatusConflict, Code: api.CodeInUse, Message: err.Error()}
	case errors.Is(err, records.ErrNotFound), errors.Is(err, records.ErrReservationGone):
		return &api.Error{Status: http.StatusNotFound, Code: api.CodeNotFound, Message: err.Error()}
	case errors.Is(err, records.ErrLeaseLost), errors.Is(err, retry.ErrConflict),
		errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return tryAgain(err)
	default:
		return &api.Error{Status: http.StatusInternalServerError, Code: api.CodeInternal, Message: err.Error()}
	}
}

// validOwner checks the fields that identify an attachment.
func validOwner(o api.Owner) error {
	field := func(f, msg string) error { return &FieldError{Field: f, Msg: msg} }
	switch {
	case o.ContainerID == "":
		return field("owner.containerID", "owner.containerID is empty")
	case len(o.ContainerID) > 256:
		return field("owner.containerID", "owner.containerID is longer than 256 characters")
	case o.IfName == "":
		return field("owner.ifName", "owner.ifName is empty")
	case len(o.IfName) > 15 || strings.ContainsAny(o.IfName, "/ \t\n:"):
		return field("owner.ifName", fmt.Sprintf("owner.ifName %q is not a valid interface name", o.IfName))
	}
	return nil
}
