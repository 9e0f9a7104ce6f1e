package cluster

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// ClientFiles are the PEM files a client of the cluster needs: the CA that
// signed the members' certificates, and a certificate and key of its own.
type ClientFiles struct {
	CAFile, CertFile, KeyFile string
}

// ClientConfig issues (on the first call for user) a client certificate
// whose CN is user and returns the files, e.g. for an agent's --etcd-*
// flags. Once auth is enabled, etcd takes the CN as the user name. A user
// name is letters, digits, '-', '_' and '.'.
func (c *Cluster) ClientConfig(user string) (ClientFiles, error) {
	return c.pki.client(user)
}

// TLSConfig is a crypto/tls configuration for user: the cluster's CA as
// the only root, and user's client certificate.
func (c *Cluster) TLSConfig(user string) (*tls.Config, error) {
	f, err := c.ClientConfig(user)
	if err != nil {
		return nil, err
	}
	cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("load client certificate of %s: %w", user, err)
	}
	pool, err := c.CAPool()
	if err != nil {
		return nil, err
	}
	return &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}

// CAPool holds the cluster's CA certificate, for a client that builds its
// own TLS configuration.
func (c *Cluster) CAPool() (*x509.CertPool, error) {
	pem, err := os.ReadFile(c.pki.caFile())
	if err != nil {
		return nil, fmt.Errorf("read ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("read ca: no certificate in %s", c.pki.caFile())
	}
	return pool, nil
}

// ClientV3Config is a clientv3 configuration for user with the given
// members as endpoints, every member when none is given. gRPC reconnects to a member that was down within 100 ms
// rather than with its default backoff of up to two minutes, and the
// client logs nothing.
//
// clientv3 balances requests over its endpoints and, without keepalives,
// does not notice a stopped member: requests sent to it wait for their
// context. Name the members to use when some will be stopped.
func (c *Cluster) ClientV3Config(user string, members ...int) (clientv3.Config, error) {
	eps := c.Endpoints()
	if len(members) > 0 {
		eps = nil
		for _, i := range members {
			m, err := c.member(i)
			if err != nil {
				return clientv3.Config{}, err
			}
			eps = append(eps, m.clientURL)
		}
	}
	tc, err := c.TLSConfig(user)
	if err != nil {
		return clientv3.Config{}, err
	}
	return clientv3.Config{
		Endpoints:   eps,
		TLS:         tc,
		DialTimeout: 5 * time.Second,
		DialOptions: []grpc.DialOption{fastReconnect},
		Logger:      zap.NewNop(),
	}, nil
}

// Client connects a client as user to the given members (every member when
// none is given), closed by t.Cleanup. It fails the test if the
// configuration cannot be built; connecting itself happens on the first
// request.
func (c *Cluster) Client(tb testing.TB, user string, members ...int) *clientv3.Client {
	tb.Helper()
	cfg, err := c.ClientV3Config(user, members...)
	if err != nil {
		tb.Fatalf("client config for %s: %v", user, err)
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		tb.Fatalf("connect to etcd as %s: %v", user, err)
	}
	tb.Cleanup(func() { _ = cli.Close() })
	return cli
}
