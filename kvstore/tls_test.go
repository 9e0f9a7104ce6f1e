package kvstore_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/kvstore"
)

// writeCert issues a certificate signed by parent (self-signed when nil)
// and writes cert and key PEM files into dir.
func writeCert(t *testing.T, dir, name string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, isCA bool) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, IsCA: isCA, BasicConstraintsValid: true,
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	require.NoError(t, err)
	kb, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, name+".pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, name+"-key.pem"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600))
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return cert, key
}

// TestConnectTLS: a client with the CA and a client certificate connects
// to an etcd that requires them; one without a client certificate, or
// without the CA, is refused with a clear error.
func TestConnectTLS(t *testing.T) {
	dir := t.TempDir()
	ca, caKey := writeCert(t, dir, "ca", nil, nil, true)
	writeCert(t, dir, "server", ca, caKey, false)
	writeCert(t, dir, "client", ca, caKey, false)
	p := func(n string) string { return filepath.Join(dir, n) }
	ctx := context.Background()
	e, err := kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{
		Dir: t.TempDir(), ClientURL: "https://127.0.0.1:0", Fast: true,
		CertFile: p("server.pem"), KeyFile: p("server-key.pem"), CAFile: p("ca.pem"),
	})
	require.NoError(t, err)
	defer e.Close()

	good := kvstore.Config{Endpoints: e.Endpoints(), CAFile: p("ca.pem"), CertFile: p("client.pem"), KeyFile: p("client-key.pem"), DialTimeout: 2 * time.Second}
	cli, err := kvstore.Connect(ctx, good, "/app/health")
	require.NoError(t, err)
	_, err = cli.Put(ctx, "/tls", "ok")
	require.NoError(t, err)
	cli.Close()

	good.DialTimeout = 500 * time.Millisecond // the refusals below wait it out
	noClientCert := good
	noClientCert.CertFile, noClientCert.KeyFile = "", ""
	_, err = kvstore.Connect(ctx, noClientCert, "/app/health")
	require.ErrorContains(t, err, "reach etcd")
	require.ErrorContains(t, err, "requires a client certificate", "the cause is named, not only a deadline")
	t.Logf("no client certificate: %v", err)

	noCA := good
	noCA.CAFile = ""
	_, err = kvstore.Connect(ctx, noCA, "/app/health")
	require.ErrorContains(t, err, "reach etcd")
	require.ErrorContains(t, err, "does not trust etcd's certificate")
	t.Logf("no CA: %v", err)

	missing := good
	missing.CAFile = p("nope.pem")
	_, err = kvstore.Connect(ctx, missing, "/app/health")
	require.ErrorContains(t, err, "load etcd tls files")

	nobody := good
	nobody.Endpoints = []string{"https://" + freeLoopback(t)}
	_, err = kvstore.Connect(ctx, nobody, "/app/health")
	require.ErrorContains(t, err, "connection refused")
}

// TestConnectAuth: etcd with authentication on accepts the configured
// user and password and refuses a wrong password.
func TestConnectAuth(t *testing.T) {
	ctx := context.Background()
	e, err := kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{Dir: t.TempDir(), Fast: true})
	require.NoError(t, err)
	defer e.Close()
	admin, err := e.Client(ctx)
	require.NoError(t, err)
	_, err = admin.UserAdd(ctx, "root", "s3cret")
	require.NoError(t, err)
	_, err = admin.UserGrantRole(ctx, "root", "root")
	require.NoError(t, err)
	_, err = admin.AuthEnable(ctx)
	require.NoError(t, err)
	admin.Close()

	cfg := e.Config()
	cfg.Username, cfg.Password = "root", "s3cret"
	// Each connection authenticates (a bcrypt check in the embedded
	// server): under the race detector on a loaded machine that can take
	// longer than the default dial bound, which this test is not about.
	cfg.DialTimeout = 2 * time.Minute
	cli, err := kvstore.Connect(ctx, cfg, "/app/health")
	require.NoError(t, err)
	_, err = cli.Put(ctx, "/auth", "ok")
	require.NoError(t, err)
	// A user whose role covers only /app/ connects (its probe key is
	// inside the prefix) and is refused elsewhere.
	_, err = cli.RoleAdd(ctx, "app")
	require.NoError(t, err)
	_, err = cli.RoleGrantPermission(ctx, "app", "/app/", clientv3.GetPrefixRangeEnd("/app/"), clientv3.PermissionType(clientv3.PermReadWrite))
	require.NoError(t, err)
	for _, u := range []string{"app", "norole"} {
		_, err = cli.UserAdd(ctx, u, "pw-"+u)
		require.NoError(t, err)
	}
	_, err = cli.UserGrantRole(ctx, "app", "app")
	require.NoError(t, err)
	cli.Close()

	cfg.Password = "wrong"
	_, err = kvstore.Connect(ctx, cfg, "/app/health")
	require.ErrorContains(t, err, "authentication failed")

	cfg.Username, cfg.Password = "app", "pw-app"
	app, err := kvstore.Connect(ctx, cfg, "/app/health")
	require.NoError(t, err, "a role on the prefix is all a client needs")
	_, err = app.Put(ctx, "/app/x", "ok")
	require.NoError(t, err)
	_, err = app.Put(ctx, "/other", "no")
	require.ErrorContains(t, err, "permission denied")
	app.Close()

	cfg.Username, cfg.Password = "norole", "pw-norole"
	_, err = kvstore.Connect(ctx, cfg, "/app/health")
	require.ErrorContains(t, err, "permission denied")
	require.ErrorContains(t, err, `user "norole" may not read /app/health`, "the refusal names the user and the key")
	t.Logf("no role: %v", err)
}

// freeLoopback is a loopback address nothing listens on.
func freeLoopback(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}
