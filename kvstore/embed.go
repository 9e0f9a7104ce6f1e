package kvstore

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// EmbedConfig configures the single-node etcd that kvipam runs in-process:
// the agent's when its configuration asks for it by name (etcd.embedded),
// the demo's, and tests'.
type EmbedConfig struct {
	// Dir holds etcd's data; it survives restarts, so state is kept.
	Dir string
	// ClientURL and PeerURL default to 127.0.0.1 with a kernel-chosen port.
	ClientURL string
	PeerURL   string
	// Fast shortens raft timers and skips fsync. Tests only: a crash can
	// lose acknowledged writes.
	Fast bool
	// StartTimeout bounds how long Start waits for the server to be ready.
	StartTimeout time.Duration
	// Name and InitialCluster ("a=http://127.0.0.1:2380,b=...") make this
	// a member of a multi-member cluster (tests of member loss); empty
	// means a single-member cluster named "kvipam".
	Name           string
	InitialCluster string
	// CertFile, KeyFile and CAFile serve clients over TLS (use an https
	// ClientURL); with CAFile set, clients must present a certificate
	// signed by it.
	CertFile, KeyFile, CAFile string
}

// Embedded is a running in-process etcd server. Close stops it.
type Embedded struct {
	etcd      *embed.Etcd
	endpoints []string
	once      sync.Once
}

// StartEmbedded starts a single-member etcd and waits until it serves.
func StartEmbedded(ctx context.Context, c EmbedConfig) (*Embedded, error) {
	if c.Dir == "" {
		return nil, fmt.Errorf("kvstore: embedded etcd needs a data dir")
	}
	if err := os.MkdirAll(c.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("create etcd data dir: %w", err)
	}
	cfg := embed.NewConfig()
	cfg.Name = orDefault(c.Name, "kvipam")
	cfg.Dir = c.Dir
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	cu, err := url.Parse(orDefault(c.ClientURL, "http://127.0.0.1:0"))
	if err != nil {
		return nil, fmt.Errorf("parse embedded etcd client url: %w", err)
	}
	pu, err := url.Parse(orDefault(c.PeerURL, "http://127.0.0.1:0"))
	if err != nil {
		return nil, fmt.Errorf("parse embedded etcd peer url: %w", err)
	}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ClientTLSInfo.CertFile, cfg.ClientTLSInfo.KeyFile = c.CertFile, c.KeyFile
	if c.CAFile != "" {
		cfg.ClientTLSInfo.TrustedCAFile, cfg.ClientTLSInfo.ClientCertAuth = c.CAFile, true
	}
	if c.InitialCluster != "" {
		cfg.InitialCluster = c.InitialCluster
		cfg.InitialClusterToken = "kvipam-test-cluster"
	}
	// Revisions are kvipam's fencing tokens; compaction only drops history,
	// never current keys, so a modest retention keeps the store small.
	cfg.AutoCompactionMode = embed.CompactorModeRevision
	cfg.AutoCompactionRetention = "10000"
	if c.Fast {
		cfg.TickMs = 10
		cfg.ElectionMs = 100
		cfg.UnsafeNoFsync = true
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("start embedded etcd in %s: %w", c.Dir, err)
	}
	timeout := c.StartTimeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(timeout):
		e.Close()
		return nil, fmt.Errorf("embedded etcd not ready after %s", timeout)
	case <-ctx.Done():
		e.Close()
		return nil, fmt.Errorf("start embedded etcd: %w", ctx.Err())
	}
	scheme := "http://"
	if c.CertFile != "" {
		scheme = "https://"
	}
	eps := make([]string, 0, len(e.Clients))
	for _, l := range e.Clients {
		eps = append(eps, scheme+l.Addr().String())
	}
	return &Embedded{etcd: e, endpoints: eps}, nil
}

// Endpoints are the client URLs the server listens on.
func (e *Embedded) Endpoints() []string { return e.endpoints }

// Config returns a client configuration for this server.
func (e *Embedded) Config() Config { return Config{Endpoints: e.endpoints} }

// Client is a convenience that connects to this server.
func (e *Embedded) Client(ctx context.Context) (*clientv3.Client, error) {
	return Connect(ctx, e.Config(), "/")
}

// Close stops the server and waits for it to release its data dir. A
// second Close does nothing.
func (e *Embedded) Close() {
	e.once.Do(func() {
		e.etcd.Close()
		<-e.etcd.Server.StopNotify()
	})
}

// IsLeader reports whether this member leads the raft group now.
func (e *Embedded) IsLeader() bool { return e.etcd.Server.Leader() == e.etcd.Server.MemberID() }

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
