package cluster

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Errors of this package, checked with errors.Is.
var (
	// ErrNoMember: the index names no member of the cluster.
	ErrNoMember = errors.New("cluster: no such member")
	// ErrNotRunning: the member has been killed (and not restarted).
	ErrNotRunning = errors.New("cluster: member not running")
	// ErrExited: the member's process ended without being killed.
	ErrExited = errors.New("cluster: member exited by itself")
	// ErrNoLeader: no member is leader with a quorum agreeing.
	ErrNoLeader = errors.New("cluster: no leader")
	// ErrBadName: a user name that cannot name a certificate file.
	ErrBadName = errors.New("cluster: bad user name")
)

// Options shape a cluster. The zero value is a 3-member cluster with
// short timers.
type Options struct {
	// Members is the number of members; 3 when zero.
	Members int
	// HeartbeatInterval is etcd's --heartbeat-interval; 50 ms when zero.
	HeartbeatInterval time.Duration
	// ElectionTimeout is etcd's --election-timeout; 10 heartbeats when zero.
	ElectionTimeout time.Duration
	// StartTimeout bounds Start's wait for a healthy cluster; 60 s when
	// zero (a first start on a loaded 2-core machine is slow).
	StartTimeout time.Duration
	// Flags are extra etcd flags appended to every member's command line.
	Flags []string
	// OwnHTTPListener gives each member's HTTP endpoints (/health,
	// /metrics, /version, /debug/pprof) a listener of their own
	// (--listen-client-http-urls, HTTPEndpoints). The client URL then
	// serves only gRPC, and grpc-go serves it itself; without it, as in
	// kubeadm's etcd, gRPC goes through Go's HTTP/2 handler on the port
	// the HTTP endpoints share, which etcd warns is not for production.
	OwnHTTPListener bool
}

// withDefaults fills the zero fields.
func (o Options) withDefaults() Options {
	if o.Members == 0 {
		o.Members = 3
	}
	if o.HeartbeatInterval == 0 {
		o.HeartbeatInterval = 50 * time.Millisecond
	}
	if o.ElectionTimeout == 0 {
		o.ElectionTimeout = 10 * o.HeartbeatInterval
	}
	if o.StartTimeout == 0 {
		o.StartTimeout = 60 * time.Second
	}
	return o
}

// Cluster is a running etcd cluster of separate processes. Its methods are
// safe for concurrent use; calls on the same member are serialised.
// Members are numbered from 0 and named m0, m1, ...
type Cluster struct {
	tb       testing.TB
	opts     Options
	bin      string
	pki      *pki
	launcher *launcher
	members  []*member

	adminMu sync.Mutex
	admin   *clientv3.Client // as RootUser, for the auth helpers
}

// Start runs a cluster for the test and waits until its members agree on a
// leader; it fails the test if they do not within opts.StartTimeout.
// Every member is killed and reaped, and every connection of the cluster's
// own closed, by t.Cleanup.
func Start(tb testing.TB, opts Options) *Cluster {
	tb.Helper()
	opts = opts.withDefaults()
	if opts.Members < 1 {
		tb.Fatalf("start etcd cluster: %d members", opts.Members)
	}
	began := time.Now()
	bin, err := etcdBinary()
	if err != nil {
		tb.Fatalf("build etcd: %v", err)
	}
	logDir, pkiDir, dataDir := tb.ArtifactDir(), tb.TempDir(), tb.TempDir()
	p, err := newPKI(pkiDir)
	if err != nil {
		tb.Fatalf("make cluster certificates: %v", err)
	}
	c := &Cluster{tb: tb, opts: opts, bin: bin, pki: p, launcher: newLauncher()}
	// Registered after the temporary directories, so it runs before they
	// are removed: no member is still writing when they go.
	tb.Cleanup(c.cleanup)

	var peers []string
	for i := range opts.Members {
		m, err := c.newMember(i, logDir, dataDir)
		if err != nil {
			tb.Fatalf("prepare member %d: %v", i, err)
		}
		c.members = append(c.members, m)
		peers = append(peers, m.name+"="+m.peerURL)
	}
	token := make([]byte, 8)
	_, _ = rand.Read(token)
	ctx, cancel := context.WithTimeout(context.Background(), opts.StartTimeout)
	defer cancel()
	built := time.Now()
	// One at a time: a new member asks each peer whether it is already
	// bootstrapped, waiting up to a second (not configurable) for a peer
	// that listens but does not serve yet; started together, members
	// often wait 2 s for each other. A peer that serves, or does not
	// listen yet, answers at once.
	for _, m := range c.members {
		m.args = c.args(m, strings.Join(peers, ","), hex.EncodeToString(token))
		if err := m.start(c.launcher); err != nil {
			tb.Fatalf("start %s: %v", m.name, err)
		}
		if err := m.waitPeerServing(ctx); err != nil {
			tb.Fatalf("start %s: %v", m.name, err)
		}
	}
	if err := c.WaitHealthy(ctx); err != nil {
		tb.Fatalf("start etcd cluster: %v", err)
	}
	tb.Logf("etcd: %d members healthy %v after start (binary ready in %v)",
		len(c.members), time.Since(built).Round(time.Millisecond), built.Sub(began).Round(time.Millisecond))
	return c
}

// newMember picks member i's ports and paths and issues its certificate.
func (c *Cluster) newMember(i int, logDir, dataDir string) (*member, error) {
	name := "m" + strconv.Itoa(i)
	clientPort, err := freePort()
	if err != nil {
		return nil, err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, err
	}
	var httpURL string
	if c.opts.OwnHTTPListener {
		httpPort, err := freePort()
		if err != nil {
			return nil, err
		}
		httpURL = fmt.Sprintf("https://127.0.0.1:%d", httpPort)
	}
	certs, err := c.pki.member(name)
	if err != nil {
		return nil, err
	}
	root, err := c.TLSConfig(RootUser)
	if err != nil {
		return nil, err
	}
	return &member{
		name:      name,
		bin:       c.bin,
		clientURL: fmt.Sprintf("https://127.0.0.1:%d", clientPort),
		peerURL:   fmt.Sprintf("https://127.0.0.1:%d", peerPort),
		httpURL:   httpURL,
		dataDir:   filepath.Join(dataDir, name),
		logPath:   filepath.Join(logDir, name+".log"),
		certs:     certs,
		statusTLS: root,
	}, nil
}

// args is member m's etcd command line. The data dir, once written, is
// what a restarted member reads; etcd then ignores the --initial-* flags.
func (c *Cluster) args(m *member, initialCluster, token string) []string {
	ms := func(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }
	args := []string{
		"--name", m.name,
		"--data-dir", m.dataDir,
		"--listen-client-urls", m.clientURL,
		"--advertise-client-urls", m.clientURL,
		"--listen-peer-urls", m.peerURL,
		"--initial-advertise-peer-urls", m.peerURL,
		"--initial-cluster", initialCluster,
		"--initial-cluster-state", "new",
		"--initial-cluster-token", "kvipam-" + token,
		"--client-cert-auth",
		"--trusted-ca-file", m.certs.CAFile,
		"--cert-file", m.certs.CertFile,
		"--key-file", m.certs.KeyFile,
		"--peer-client-cert-auth",
		"--peer-trusted-ca-file", m.certs.CAFile,
		"--peer-cert-file", m.certs.CertFile,
		"--peer-key-file", m.certs.KeyFile,
		"--heartbeat-interval", ms(c.opts.HeartbeatInterval),
		"--election-timeout", ms(c.opts.ElectionTimeout),
		"--unsafe-no-fsync",
		"--enable-grpc-gateway=false",
		"--log-level", "warn",
		"--log-format", "console",
		"--log-outputs", "stderr",
	}
	if m.httpURL != "" {
		args = append(args, "--listen-client-http-urls", m.httpURL)
	}
	return append(args, c.opts.Flags...)
}

// Len is the number of members.
func (c *Cluster) Len() int { return len(c.members) }

// Endpoints are every member's client URL, in member order.
func (c *Cluster) Endpoints() []string {
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = m.clientURL
	}
	return eps
}

// HTTPEndpoints are every member's URL for its HTTP endpoints (/health,
// /metrics, /debug/pprof), in member order: the client URL unless
// Options.OwnHTTPListener gave them their own.
func (c *Cluster) HTTPEndpoints() []string {
	eps := make([]string, len(c.members))
	for i, m := range c.members {
		eps[i] = cmp.Or(m.httpURL, m.clientURL)
	}
	return eps
}

// LogPath is the file member i logs to (every run of it, appended).
func (c *Cluster) LogPath(i int) string {
	if i < 0 || i >= len(c.members) {
		return ""
	}
	return c.members[i].logPath
}

// member returns member i.
func (c *Cluster) member(i int) (*member, error) {
	if i < 0 || i >= len(c.members) {
		return nil, fmt.Errorf("member %d of %d: %w", i, len(c.members), ErrNoMember)
	}
	return c.members[i], nil
}

// cleanup kills every member, closes the cluster's connections and, if
// the test failed, prints where the logs are and how they end.
func (c *Cluster) cleanup() {
	for _, m := range c.members {
		if err := m.kill(); err != nil && !errors.Is(err, ErrNotRunning) {
			c.tb.Errorf("stop %s: %v", m.name, err)
		}
	}
	c.launcher.close()
	c.adminMu.Lock()
	if c.admin != nil {
		_ = c.admin.Close()
		c.admin = nil
	}
	c.adminMu.Unlock()
	if !c.tb.Failed() {
		return
	}
	for _, m := range c.members {
		c.tb.Logf("etcd %s log: %s (kept with go test -artifacts); it ends:\n%s", m.name, m.logPath, tail(m.logPath, 40))
	}
}

// tail is the last n lines of the file at path, or why there are none.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
