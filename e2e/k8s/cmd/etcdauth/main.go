// Command etcdauth runs docs/operations.md's "Turning authentication on in
// a shared etcd" against the test cluster's etcd, the etcdctl commands
// there done with etcd's client (no etcdctl is at hand), in the same
// order: kvipam's role and user, the root user, the API server's user
// first, then auth enable.
//
//	etcdauth --endpoint URL --cacert CA --cert CRT --key KEY --root-password PW
//	etcdauth --endpoint URL --cacert CA --cert CRT --key KEY --check-user
//	etcdauth --endpoint URL --cacert CA --cert CRT --key KEY --forget
//
// --check-user reads /kvipam/ and /registry/ as the certificate's user and
// prints what each answered. --forget is docs/kubernetes.md's last
// uninstall step, etcdctl del --prefix /kvipam/, and prints how many keys
// went.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "etcdauth:", err)
		os.Exit(1)
	}
}

func run() error {
	endpoint := flag.String("endpoint", "", "etcd's client URL")
	ca := flag.String("cacert", "", "CA of etcd's certificate")
	cert := flag.String("cert", "", "client certificate (any, while authentication is off)")
	key := flag.String("key", "", "its key")
	rootPW := flag.String("root-password", "", "the root user's password")
	check := flag.Bool("check-user", false, "read /kvipam/ and /registry/ and print the answers")
	forget := flag.Bool("forget", false, "delete every key under /kvipam/")
	flag.Parse()
	pair, err := tls.LoadX509KeyPair(*cert, *key)
	if err != nil {
		return fmt.Errorf("client certificate: %w", err)
	}
	caPEM, err := os.ReadFile(*ca)
	if err != nil {
		return fmt.Errorf("read CA: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{*endpoint}, DialTimeout: 30 * time.Second,
		TLS: &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: pool, MinVersion: tls.VersionTLS12}})
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if *check {
		for _, prefix := range []string{"/kvipam/", "/registry/"} {
			_, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
			fmt.Printf("%s: %v\n", prefix, err)
		}
		return nil
	}
	if *forget {
		r, err := cli.Delete(ctx, "/kvipam/", clientv3.WithPrefix())
		if err != nil {
			return fmt.Errorf("del --prefix /kvipam/: %w", err)
		}
		fmt.Printf("etcdctl del --prefix /kvipam/: %d keys\n", r.Deleted)
		return nil
	}
	noPassword := &clientv3.UserAddOptions{NoPassword: true}
	steps := []struct {
		what string
		f    func() error
	}{
		{"role add kvipam", func() error { _, err := cli.RoleAdd(ctx, "kvipam"); return err }},
		{"role grant-permission kvipam --prefix=true readwrite /kvipam/", func() error {
			_, err := cli.RoleGrantPermission(ctx, "kvipam", "/kvipam/", clientv3.GetPrefixRangeEnd("/kvipam/"), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		}},
		{"user add kvipam --no-password", func() error { _, err := cli.UserAddWithOptions(ctx, "kvipam", "", noPassword); return err }},
		{"user grant-role kvipam kvipam", func() error { _, err := cli.UserGrantRole(ctx, "kvipam", "kvipam"); return err }},
		{"user add root", func() error { _, err := cli.UserAdd(ctx, "root", *rootPW); return err }},
		{"user grant-role root root", func() error { _, err := cli.UserGrantRole(ctx, "root", "root"); return err }},
		{"user add kube-apiserver-etcd-client --no-password", func() error {
			_, err := cli.UserAddWithOptions(ctx, "kube-apiserver-etcd-client", "", noPassword)
			return err
		}},
		{"user grant-role kube-apiserver-etcd-client root", func() error {
			_, err := cli.UserGrantRole(ctx, "kube-apiserver-etcd-client", "root")
			return err
		}},
		{"auth enable", func() error { _, err := cli.AuthEnable(ctx); return err }},
	}
	for _, s := range steps {
		if err := s.f(); err != nil {
			return fmt.Errorf("%s: %w", s.what, err)
		}
		fmt.Println("etcdctl", s.what)
	}
	return nil
}
