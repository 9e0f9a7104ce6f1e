package agent

import (
	"errors"
	"fmt"
	"strings"

	"github.com/kvipam/kvipam/kvstore"
)

// EtcdConfig is the etcd section of the agent's configuration: which etcd
// the agent uses. Endpoints name the cluster's etcd; Embedded asks, by
// name, for a single-member etcd of this node's own in <stateDir>/etcd.
// Exactly one of them is given: an agent never falls back to an etcd of
// its own because its configuration names none (invariant 9), since that
// etcd would hand out addresses the cluster's etcd never sees.
type EtcdConfig struct {
	Endpoints []string `json:"endpoints"`
	// Embedded runs the embedded etcd: a lab, a demo, a single node, or
	// the etcd other agents of a small lab cluster use (EmbeddedListen).
	Embedded bool `json:"embedded"`
	// DialTimeout bounds the first connection and its check.
	DialTimeout Duration `json:"dialTimeout"`
	// CallTimeout abandons one etcd request not answered in this time
	// (a leader lost, a member gone); the outcome of an abandoned write
	// is read back.
	CallTimeout Duration `json:"callTimeout"`
	// CAFile verifies etcd's certificate; CertFile and KeyFile are the
	// client's. Any of them turns TLS on.
	CAFile   string `json:"caFile"`
	CertFile string `json:"certFile"`
	KeyFile  string `json:"keyFile"`
	Username string `json:"username"`
	Password string `json:"password"`
}

// Client is how to reach the cluster's etcd (not the embedded one).
func (e EtcdConfig) Client() kvstore.Config {
	return kvstore.Config{
		Endpoints: e.Endpoints, DialTimeout: e.DialTimeout.Duration, CallTimeout: e.CallTimeout.Duration,
		CAFile: e.CAFile, CertFile: e.CertFile, KeyFile: e.KeyFile, Username: e.Username, Password: e.Password,
	}
}

// howToChoose names both ways to say which etcd, in every source.
const howToChoose = "name the cluster's etcd (etcd.endpoints in the file, --etcd-endpoints or KVIPAM_ETCD_ENDPOINTS), " +
	"or ask for an embedded single-member etcd of this node's own in <state-dir>/etcd by name " +
	"(etcd.embedded: true in the file, --etcd-embedded or KVIPAM_ETCD_EMBEDDED=true)"

// validate checks that exactly one etcd is chosen, and that what is set
// applies to it. embeddedListen is the agent's EmbeddedListen.
func (e EtcdConfig) validate(embeddedListen string) error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	switch {
	case len(e.Endpoints) == 0 && !e.Embedded:
		bad("etcd: no endpoints, and no embedded etcd asked for: %s", howToChoose)
	case len(e.Endpoints) > 0 && e.Embedded:
		bad("etcd: both endpoints (%s) and embedded are set: an agent uses the cluster's etcd or an embedded one; remove one",
			strings.Join(e.Endpoints, ","))
	case e.Embedded:
		if e.CAFile != "" || e.CertFile != "" || e.KeyFile != "" || e.Username != "" || e.Password != "" {
			bad("etcd: caFile, certFile, keyFile, username and password are for the cluster's etcd; the embedded etcd takes none")
		}
		if e.DialTimeout.Duration < 0 || e.CallTimeout.Duration < 0 {
			bad("etcd: dialTimeout and callTimeout must not be negative")
		}
	default:
		if err := e.Client().Validate(); err != nil {
			bad("etcd: %w", err)
		}
	}
	if embeddedListen != "" && !e.Embedded {
		bad("embedded-etcd-listen: %q is set, but no embedded etcd is asked for (etcd.embedded: true, --etcd-embedded)", embeddedListen)
	}
	return errors.Join(errs...)
}
