package kvstore

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Config says how to reach etcd: Endpoints name at least one member
// (Validate). It is no file format: the agent's configuration has its own
// etcd section (agent.EtcdConfig), read strictly, and an embedded etcd is
// reached by its own Config (Embedded.Config).
type Config struct {
	Endpoints   []string
	DialTimeout time.Duration
	// CallTimeout bounds each request (zero: DefaultCallTimeout). The
	// kvstore client does not apply it; stores built on the client do
	// (WithCallTimeout).
	CallTimeout time.Duration
	// CertFile and KeyFile are the client certificate; CAFile verifies the
	// server. Any of them set turns TLS on.
	CertFile string
	KeyFile  string
	CAFile   string
	Username string
	Password string
}

// DefaultDialTimeout bounds the first connection when Config leaves it zero.
const DefaultDialTimeout = 5 * time.Second

// ErrNoEndpoints is returned by Connect when the configuration names no etcd.
var ErrNoEndpoints = errors.New("kvstore: no etcd endpoints configured")

// Validate reports configuration mistakes before any dialing happens.
func (c Config) Validate() error {
	if len(c.Endpoints) == 0 {
		return ErrNoEndpoints
	}
	if (c.CertFile == "") != (c.KeyFile == "") {
		return fmt.Errorf("kvstore: etcd TLS needs both certFile and keyFile (got cert %q, key %q)", c.CertFile, c.KeyFile)
	}
	if c.Password != "" && c.Username == "" {
		return errors.New("kvstore: etcd password given without username")
	}
	if c.DialTimeout < 0 {
		return fmt.Errorf("kvstore: negative dial timeout %s", c.DialTimeout)
	}
	if c.CallTimeout < 0 {
		return fmt.Errorf("kvstore: negative call timeout %s", c.CallTimeout)
	}
	return nil
}

func (c Config) tlsConfig() (*tls.Config, error) {
	if c.CertFile == "" && c.KeyFile == "" && c.CAFile == "" {
		return nil, nil
	}
	info := transport.TLSInfo{CertFile: c.CertFile, KeyFile: c.KeyFile, TrustedCAFile: c.CAFile}
	tc, err := info.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("load etcd tls files: %w", err)
	}
	return tc, nil
}

// Connect dials etcd and checks, by a count-only read of probe, that it
// answers within the dial timeout and accepts the credentials, so a wrong
// endpoint, certificate or role is reported at start-up rather than on the
// first request. probe must be a key the user may read (the kvipam schema
// has one inside its prefix, so a role on that prefix is enough). A failure
// names its cause: nothing listening, a TLS refusal (no client
// certificate, an untrusted server certificate), bad credentials, or a
// user without permission. ctx bounds only that first check; the client
// lives until Close.
func Connect(ctx context.Context, c Config, probe string) (*clientv3.Client, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	tc, err := c.tlsConfig()
	if err != nil {
		return nil, err
	}
	timeout := c.DialTimeout
	if timeout == 0 {
		timeout = DefaultDialTimeout
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            c.Endpoints,
		DialTimeout:          timeout,
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 3 * time.Second,
		TLS:                  tc,
		Username:             c.Username,
		Password:             c.Password,
		Logger:               zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("create etcd client for %v: %w", c.Endpoints, explain(ctx, c, tc, err))
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if _, err := cli.Get(cctx, probe, clientv3.WithCountOnly()); err != nil {
		cli.Close()
		if errors.Is(err, rpctypes.ErrPermissionDenied) {
			return nil, fmt.Errorf("etcd user %q may not read %s: %w (grant the user a role with read and write on the kvipam prefix)", c.user(), probe, err)
		}
		return nil, fmt.Errorf("reach etcd at %v: %w", c.Endpoints, explain(ctx, c, tc, Unavailable(err)))
	}
	return cli, nil
}

// user is who etcd takes the client to be: the configured user, else the
// client certificate's common name.
func (c Config) user() string {
	if c.Username != "" {
		return c.Username
	}
	if c.CertFile != "" {
		if data, err := os.ReadFile(c.CertFile); err == nil {
			if b, _ := pem.Decode(data); b != nil {
				if cert, err := x509.ParseCertificate(b.Bytes); err == nil {
					return cert.Subject.CommonName
				}
			}
		}
	}
	return ""
}

// explain adds to err what a direct connection to each endpoint says: a
// gRPC client that cannot connect reports only its deadline, while the
// cause (nothing listening, a TLS alert) is seen on the wire.
func explain(ctx context.Context, c Config, tc *tls.Config, err error) error {
	if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, retry.ErrUnavailable) {
		return err
	}
	var causes []string
	for _, ep := range c.Endpoints {
		if cause := probeEndpoint(ctx, ep, tc, c.CertFile != ""); cause != "" {
			causes = append(causes, cause)
		}
	}
	if len(causes) == 0 {
		return err
	}
	return fmt.Errorf("%s: %w", strings.Join(causes, "; "), err)
}

// probeEndpoint dials one endpoint as the client would and returns why it
// refuses, or "" if it looks fine.
func probeEndpoint(ctx context.Context, endpoint string, tc *tls.Config, haveCert bool) string {
	host := endpoint
	if u, err := url.Parse(endpoint); err == nil && u.Host != "" {
		host = u.Host
	}
	d := &net.Dialer{Timeout: time.Second}
	conn, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		return fmt.Sprintf("%s: %v", endpoint, err)
	}
	defer conn.Close()
	if tc == nil {
		return ""
	}
	cfg := tc.Clone()
	if cfg.ServerName == "" {
		cfg.ServerName, _, _ = net.SplitHostPort(host)
	}
	tconn := tls.Client(conn, cfg)
	_ = tconn.SetDeadline(time.Now().Add(time.Second))
	err = tconn.HandshakeContext(ctx)
	if err == nil {
		// TLS 1.3 servers send their verdict on the client certificate
		// after the handshake: read to see it.
		_, err = tconn.Read(make([]byte, 1))
	}
	var uae x509.UnknownAuthorityError
	var ve *tls.CertificateVerificationError
	switch {
	case err == nil, errors.Is(err, os.ErrDeadlineExceeded):
		return ""
	case errors.As(err, &uae), errors.As(err, &ve):
		return fmt.Sprintf("%s: this client does not trust etcd's certificate (%v): set the CA file (--etcd-cacert)", endpoint, err)
	case strings.Contains(err.Error(), "certificate required"), strings.Contains(err.Error(), "bad certificate"):
		if !haveCert {
			return fmt.Sprintf("%s: etcd requires a client certificate and none is configured (--etcd-cert, --etcd-key): %v", endpoint, err)
		}
		return fmt.Sprintf("%s: etcd refused the client certificate: %v", endpoint, err)
	default:
		return fmt.Sprintf("%s: %v", endpoint, err)
	}
}
