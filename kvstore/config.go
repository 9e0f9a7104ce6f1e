package kvstore

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Config says how to reach etcd. An empty Endpoints list means "use the
// embedded etcd"; that choice is the caller's (see Embedded).
type Config struct {
	Endpoints   []string      `json:"endpoints,omitempty" yaml:"endpoints,omitempty"`
	DialTimeout time.Duration `json:"dialTimeout,omitempty" yaml:"dialTimeout,omitempty"`
	// CertFile and KeyFile are the client certificate; CAFile verifies the
	// server. Any of them set turns TLS on.
	CertFile string `json:"certFile,omitempty" yaml:"certFile,omitempty"`
	KeyFile  string `json:"keyFile,omitempty" yaml:"keyFile,omitempty"`
	CAFile   string `json:"caFile,omitempty" yaml:"caFile,omitempty"`
	Username string `json:"username,omitempty" yaml:"username,omitempty"`
	Password string `json:"password,omitempty" yaml:"password,omitempty"`
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

// Connect dials etcd and checks that it answers within the dial timeout, so
// a wrong endpoint is reported at start-up rather than on the first request.
// ctx bounds only that first check; the client lives until Close.
func Connect(ctx context.Context, c Config) (*clientv3.Client, error) {
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
		return nil, fmt.Errorf("create etcd client for %v: %w", c.Endpoints, err)
	}
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if _, err := cli.Get(cctx, "health-check-kvipam", clientv3.WithCountOnly()); err != nil {
		cli.Close()
		return nil, fmt.Errorf("reach etcd at %v: %w", c.Endpoints, err)
	}
	return cli, nil
}

// UnmarshalJSON reads dialTimeout as a Go duration string ("5s"), as
// configuration files write it, or as nanoseconds.
func (c *Config) UnmarshalJSON(b []byte) error {
	type plain Config
	var aux struct {
		plain
		DialTimeout json.RawMessage `json:"dialTimeout,omitempty"`
	}
	if err := json.Unmarshal(b, &aux); err != nil {
		return err
	}
	*c = Config(aux.plain)
	if len(aux.DialTimeout) == 0 {
		return nil
	}
	var s string
	if err := json.Unmarshal(aux.DialTimeout, &s); err == nil {
		d, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("dialTimeout %q: %w", s, err)
		}
		c.DialTimeout = d
		return nil
	}
	return json.Unmarshal(aux.DialTimeout, &c.DialTimeout)
}
