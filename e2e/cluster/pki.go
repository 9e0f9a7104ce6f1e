package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// pki is one cluster's certificate authority and the certificates it has
// issued, as PEM files in dir. It is safe for concurrent use.
type pki struct {
	dir    string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	mu     sync.Mutex
	issued map[string]ClientFiles // by file name stem
}

// newPKI makes a CA in dir, valid for a day (longer than any test).
func newPKI(dir string) (*pki, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate ca key: %w", err)
	}
	tmpl, err := template("kvipam test cluster CA")
	if err != nil {
		return nil, err
	}
	tmpl.IsCA = true
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
	p := &pki{dir: dir, caKey: key, issued: map[string]ClientFiles{}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("create ca certificate: %w", err)
	}
	if p.ca, err = x509.ParseCertificate(der); err != nil {
		return nil, fmt.Errorf("parse ca certificate: %w", err)
	}
	if err := writePEM(p.caFile(), "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *pki) caFile() string { return filepath.Join(p.dir, "ca.pem") }

// member issues (once) the certificate a member serves and dials its
// peers with: IP SAN 127.0.0.1 and DNS localhost, server and client use.
func (p *pki) member(name string) (ClientFiles, error) {
	return p.issue("member-"+name, name, true)
}

// client issues (once) a client certificate whose CN is user: with
// --client-cert-auth, etcd takes the CN as the user name.
func (p *pki) client(user string) (ClientFiles, error) {
	if err := checkName(user); err != nil {
		return ClientFiles{}, err
	}
	return p.issue("client-"+user, user, false)
}

// issue returns the files named stem, creating them on the first call.
func (p *pki) issue(stem, cn string, server bool) (ClientFiles, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if f, ok := p.issued[stem]; ok {
		return f, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return ClientFiles{}, fmt.Errorf("generate key for %s: %w", cn, err)
	}
	tmpl, err := template(cn)
	if err != nil {
		return ClientFiles{}, err
	}
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	if server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
		tmpl.DNSNames = []string{"localhost"}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		return ClientFiles{}, fmt.Errorf("create certificate for %s: %w", cn, err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return ClientFiles{}, fmt.Errorf("marshal key for %s: %w", cn, err)
	}
	f := ClientFiles{
		CAFile:   p.caFile(),
		CertFile: filepath.Join(p.dir, stem+".pem"),
		KeyFile:  filepath.Join(p.dir, stem+"-key.pem"),
	}
	if err := writePEM(f.CertFile, "CERTIFICATE", der); err != nil {
		return ClientFiles{}, err
	}
	if err := writePEM(f.KeyFile, "EC PRIVATE KEY", keyDER); err != nil {
		return ClientFiles{}, err
	}
	p.issued[stem] = f
	return f, nil
}

// template is a certificate valid from an hour ago until a day from now,
// with a random serial number.
func template(cn string) (*x509.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generate serial number: %w", err)
	}
	now := time.Now()
	return &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn, Organization: []string{"kvipam tests"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		BasicConstraintsValid: true,
	}, nil
}

// writePEM writes one PEM block to path, readable by the owner only.
func writePEM(path, typ string, der []byte) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	return nil
}

// checkName refuses a user name that cannot be part of a file name.
func checkName(name string) error {
	if name == "" || name[0] == '.' {
		return fmt.Errorf("user name %q: %w", name, ErrBadName)
	}
	for _, r := range name {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.'
		if !ok {
			return fmt.Errorf("user name %q: %w", name, ErrBadName)
		}
	}
	return nil
}
