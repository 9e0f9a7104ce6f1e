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
	cli, err := kvstore.Connect(ctx, good)
	require.NoError(t, err)
	_, err = cli.Put(ctx, "/tls", "ok")
	require.NoError(t, err)
	cli.Close()

	good.DialTimeout = 500 * time.Millisecond // the refusals below wait it out
	noClientCert := good
	noClientCert.CertFile, noClientCert.KeyFile = "", ""
	_, err = kvstore.Connect(ctx, noClientCert)
	require.ErrorContains(t, err, "reach etcd")

	noCA := good
	noCA.CAFile = ""
	_, err = kvstore.Connect(ctx, noCA)
	require.ErrorContains(t, err, "reach etcd")

	missing := good
	missing.CAFile = p("nope.pem")
	_, err = kvstore.Connect(ctx, missing)
	require.ErrorContains(t, err, "load etcd tls files")
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
	cli, err := kvstore.Connect(ctx, cfg)
	require.NoError(t, err)
	_, err = cli.Put(ctx, "/auth", "ok")
	require.NoError(t, err)
	cli.Close()

	cfg.Password = "wrong"
	_, err = kvstore.Connect(ctx, cfg)
	require.ErrorContains(t, err, "authentication failed")
}
