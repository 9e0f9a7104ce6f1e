package agent

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/kvipam/kvipam/agent/client"
)

// probeTimeout bounds a probe's call to the agent's socket, as
// `kvipam-agent health` bounds its own.
const probeTimeout = 2 * time.Second

// probeResult is what /livez and /readyz answer, with 200 when healthy
// and 503 otherwise.
type probeResult struct {
	Node  string `json:"node,omitempty"`
	Ready bool   `json:"ready"`
	Error string `json:"error,omitempty"`
}

// probeHandler answers a container's HTTP probe on the metrics listener:
// liveness when live, readiness otherwise, exactly as `kvipam-agent
// health [--live]` answers an exec probe, by asking the agent's own
// socket (client.Probe) on a connection of its own. So a socket that
// stops answering, or is removed, fails the liveness probe as it failed
// the exec one.
//
// Why the HTTP probe: the kubelet makes it in its own process, while each
// exec probe is a runc exec into the container and a start of the agent's
// binary, whose package initialisation (the etcd, gRPC and BGP protobuf
// registries) alone is 16 of its 28 ms of CPU; at one probe every 5 s and
// one every 10 s that was a node's steady cost of running kvipam.
func probeHandler(socket string, live bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), probeTimeout)
		defer cancel()
		c := client.New(socket, probeTimeout)
		defer c.CloseIdleConnections()
		st, err := c.Probe(ctx, live)
		res, code := probeResult{}, http.StatusOK
		if st != nil {
			res.Node, res.Ready = st.Node, st.Ready
		}
		if err != nil {
			res.Error, code = err.Error(), http.StatusServiceUnavailable
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(res)
	})
}
