package k8s

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
	"time"
)

// --- certificates (Go crypto: one CA, every component's pair) ---

type certSpec struct {
	name   string
	cn     string
	orgs   []string
	ips    []string
	dns    []string
	server bool
	client bool
}

func (c *kcluster) makePKI() error {
	if err := os.MkdirAll(c.pki, 0o700); err != nil {
		return err
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvipam-k8s-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.pki, "ca.crt"), "CERTIFICATE", caDER); err != nil {
		return err
	}
	specs := []certSpec{
		{name: "etcd", cn: "etcd", ips: []string{routerIP, "127.0.0.1"}, server: true, client: true},
		{name: "kvipam", cn: "kvipam", client: true},
		{name: "apiserver-etcd", cn: "kube-apiserver-etcd-client", client: true},
		{name: "apiserver", cn: "kube-apiserver", ips: []string{routerIP, "10.96.0.1", "127.0.0.1"},
			dns: []string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}, server: true},
		{name: "apiserver-kubelet", cn: "kube-apiserver-kubelet-client", orgs: []string{"system:masters"}, client: true},
		{name: "admin", cn: "kubernetes-admin", orgs: []string{"system:masters"}, client: true},
		{name: "controller-manager", cn: "system:kube-controller-manager", client: true},
		{name: "scheduler", cn: "system:kube-scheduler", client: true},
		{name: "kubelet-n1", cn: "system:node:n1", orgs: []string{"system:nodes"}, client: true},
		{name: "kubelet-n2", cn: "system:node:n2", orgs: []string{"system:nodes"}, client: true},
	}
	for i, s := range specs {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(int64(i + 2)), Subject: pkix.Name{CommonName: s.cn, Organization: s.orgs},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, DNSNames: s.dns}
		for _, ip := range s.ips {
			tmpl.IPAddresses = append(tmpl.IPAddresses, net.ParseIP(ip))
		}
		if s.server {
			tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		}
		if s.client {
			tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			return err
		}
		if err := writePEM(filepath.Join(c.pki, s.name+".crt"), "CERTIFICATE", der); err != nil {
			return err
		}
		kder, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			return err
		}
		if err := writePEM(filepath.Join(c.pki, s.name+".key"), "EC PRIVATE KEY", kder); err != nil {
			return err
		}
	}
	// The service accounts' signing pair.
	sa, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	kder, err := x509.MarshalECPrivateKey(sa)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.pki, "sa.key"), "EC PRIVATE KEY", kder); err != nil {
		return err
	}
	pder, err := x509.MarshalPKIXPublicKey(&sa.PublicKey)
	if err != nil {
		return err
	}
	if err := writePEM(filepath.Join(c.pki, "sa.pub"), "PUBLIC KEY", pder); err != nil {
		return err
	}
	// Kubeconfigs.
	for _, who := range []string{"admin", "controller-manager", "scheduler", "kubelet-n1", "kubelet-n2"} {
		kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: k
  cluster: {server: %q, certificate-authority: %q}
users:
- name: u
  user: {client-certificate: %q, client-key: %q}
contexts:
- name: k
  context: {cluster: k, user: u}
current-context: k
`, apiURL, filepath.Join(c.pki, "ca.crt"), filepath.Join(c.pki, who+".crt"), filepath.Join(c.pki, who+".key"))
		if err := os.WriteFile(filepath.Join(c.pki, who+".kubeconfig"), []byte(kc), 0o600); err != nil {
			return err
		}
	}
	c.kubecfg = filepath.Join(c.pki, "admin.kubeconfig")
	return nil
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

// --- network: a router namespace with a bridge, a namespace per node ---

func (c *kcluster) makeNetwork() error {
	ipn := func(ns string, args ...string) error {
		_, err := run("ip", append([]string{"-n", ns}, args...)...)
		return err
	}
	if _, err := run("ip", "netns", "add", c.router); err != nil {
		return err
	}
	for _, a := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "br0", "type", "bridge"},
		{"addr", "add", routerIP + "/24", "dev", "br0"},
		{"addr", "add", routerIP6 + "/64", "dev", "br0", "nodad"},
		{"link", "set", "br0", "up"},
	} {
		if err := ipn(c.router, a...); err != nil {
			return err
		}
	}
	for i, name := range []string{"n1", "n2"} {
		n := &knode{name: name, netns: "k8s" + name + "-" + c.suffix, ip: fmt.Sprintf("172.30.0.%d", 11+i),
			ip6: fmt.Sprintf("fd00:30::%d", 11+i), dir: filepath.Join(c.dir, name), cgroup: "/kvipam-k8s-" + c.suffix + "-" + name}
		c.nodes = append(c.nodes, n)
		if _, err := run("ip", "netns", "add", n.netns); err != nil {
			return err
		}
		peer := "v" + name
		for _, a := range [][]string{
			{"link", "add", "eth0", "type", "veth", "peer", "name", peer},
			{"link", "set", peer, "netns", c.router},
		} {
			if err := ipn(n.netns, a...); err != nil {
				return err
			}
		}
		for _, a := range [][]string{{"link", "set", peer, "master", "br0"}, {"link", "set", peer, "up"}} {
			if err := ipn(c.router, a...); err != nil {
				return err
			}
		}
		for _, a := range [][]string{
			{"link", "set", "lo", "up"},
			{"addr", "add", n.ip + "/24", "dev", "eth0"},
			{"addr", "add", n.ip6 + "/64", "dev", "eth0", "nodad"},
			{"link", "set", "eth0", "up"},
			{"route", "add", "default", "via", routerIP},
			{"-6", "route", "add", "default", "via", routerIP6},
		} {
			if err := ipn(n.netns, a...); err != nil {
				return err
			}
		}
		// A node forwards for its pods (its own namespace's sysctls).
		for _, f := range []string{"net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"} {
			if _, err := run("ip", "netns", "exec", n.netns, "sh", "-c", "echo 1 > /proc/sys/"+f); err != nil {
				return err
			}
		}
	}
	return nil
}
