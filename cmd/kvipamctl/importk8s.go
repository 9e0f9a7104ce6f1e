package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"

	"github.com/kvipam/kvipam/allocator/adopt/whereabouts"
)

// exportWhereabouts reads through the Kubernetes API what `kubectl get
// ippools.whereabouts.cni.cncf.io,overlappingrangeipreservations.whereabouts.cni.cncf.io,pods
// -A -o json` prints: one List of the three kinds. It is a small REST
// client of three GETs over the kubeconfig's current context (server,
// CA, client certificate or token): k8s.io/client-go would bring a large
// tree of modules into kvipamctl for three list calls.
func exportWhereabouts(ctx context.Context, kubeconfig string) ([]byte, error) {
	kc, err := readKubeconfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	hc, err := kc.httpClient()
	if err != nil {
		return nil, err
	}
	out := struct {
		APIVersion string            `json:"apiVersion"`
		Kind       string            `json:"kind"`
		Items      []json.RawMessage `json:"items"`
	}{APIVersion: "v1", Kind: "List"}
	for _, r := range []struct{ path, apiVersion, kind string }{
		{"/apis/" + whereabouts.Group + "/v1alpha1/ippools", whereabouts.Group + "/v1alpha1", "IPPool"},
		{"/apis/" + whereabouts.Group + "/v1alpha1/overlappingrangeipreservations", whereabouts.Group + "/v1alpha1", "OverlappingRangeIPReservation"},
		{"/api/v1/pods", "v1", "Pod"},
	} {
		items, err := kc.list(ctx, hc, r.path)
		if err != nil {
			return nil, err
		}
		for _, it := range items {
			// A list's items carry no kind: give each its own, as
			// kubectl's List does.
			var m map[string]json.RawMessage
			if err := json.Unmarshal(it, &m); err != nil {
				return nil, fmt.Errorf("GET %s: %w", r.path, err)
			}
			m["apiVersion"], _ = json.Marshal(r.apiVersion)
			m["kind"], _ = json.Marshal(r.kind)
			b, err := json.Marshal(m)
			if err != nil {
				return nil, err
			}
			out.Items = append(out.Items, b)
		}
	}
	return json.Marshal(out)
}

// kubeconfig is the current context's cluster and user, as read.
type kubeconfig struct {
	dir                       string
	server                    string
	caData, certData, keyData []byte
	token                     string
	insecure                  bool
}

func readKubeconfig(path string) (kubeconfig, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return kubeconfig{}, err
	}
	var f struct {
		CurrentContext string `json:"current-context"`
		Clusters       []struct {
			Name    string `json:"name"`
			Cluster struct {
				Server   string `json:"server"`
				CA       string `json:"certificate-authority"`
				CAData   string `json:"certificate-authority-data"`
				Insecure bool   `json:"insecure-skip-tls-verify"`
			} `json:"cluster"`
		} `json:"clusters"`
		Users []struct {
			Name string `json:"name"`
			User struct {
				Cert     string `json:"client-certificate"`
				CertData string `json:"client-certificate-data"`
				Key      string `json:"client-key"`
				KeyData  string `json:"client-key-data"`
				Token    string `json:"token"`
			} `json:"user"`
		} `json:"users"`
		Contexts []struct {
			Name    string `json:"name"`
			Context struct {
				Cluster string `json:"cluster"`
				User    string `json:"user"`
			} `json:"context"`
		} `json:"contexts"`
	}
	if err := yaml.Unmarshal(raw, &f); err != nil {
		return kubeconfig{}, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	kc := kubeconfig{dir: filepath.Dir(path)}
	var clusterName, userName string
	for _, c := range f.Contexts {
		if c.Name == f.CurrentContext || (f.CurrentContext == "" && len(f.Contexts) == 1) {
			clusterName, userName = c.Context.Cluster, c.Context.User
		}
	}
	if clusterName == "" {
		return kubeconfig{}, fmt.Errorf("kubeconfig %s: no context %q", path, f.CurrentContext)
	}
	for _, c := range f.Clusters {
		if c.Name != clusterName {
			continue
		}
		kc.server, kc.insecure = c.Cluster.Server, c.Cluster.Insecure
		if kc.caData, err = kc.data(c.Cluster.CAData, c.Cluster.CA); err != nil {
			return kubeconfig{}, err
		}
	}
	for _, u := range f.Users {
		if u.Name != userName {
			continue
		}
		kc.token = u.User.Token
		if kc.certData, err = kc.data(u.User.CertData, u.User.Cert); err != nil {
			return kubeconfig{}, err
		}
		if kc.keyData, err = kc.data(u.User.KeyData, u.User.Key); err != nil {
			return kubeconfig{}, err
		}
	}
	if kc.server == "" {
		return kubeconfig{}, fmt.Errorf("kubeconfig %s: cluster %q has no server", path, clusterName)
	}
	return kc, nil
}

// data is inline base64 data, or the file it names (relative to the
// kubeconfig's directory).
func (kc kubeconfig) data(inline, file string) ([]byte, error) {
	switch {
	case inline != "":
		return base64.StdEncoding.DecodeString(inline)
	case file == "":
		return nil, nil
	case !filepath.IsAbs(file):
		file = filepath.Join(kc.dir, file)
	}
	return os.ReadFile(file)
}

func (kc kubeconfig) httpClient() (*http.Client, error) {
	tc := &tls.Config{InsecureSkipVerify: kc.insecure} //nolint:gosec // as the kubeconfig asks
	if len(kc.caData) > 0 {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(kc.caData) {
			return nil, fmt.Errorf("kubeconfig: the certificate authority holds no PEM certificate")
		}
		tc.RootCAs = pool
	}
	if len(kc.certData) > 0 {
		cert, err := tls.X509KeyPair(kc.certData, kc.keyData)
		if err != nil {
			return nil, fmt.Errorf("kubeconfig: client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: tc, Proxy: http.ProxyFromEnvironment}}, nil
}

// list GETs a list and returns its items; a resource the server does not
// serve (whereabouts' CRDs not installed) is an error naming it.
func (kc kubeconfig) list(ctx context.Context, hc *http.Client, path string) ([]json.RawMessage, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, kc.server+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	if kc.token != "" {
		req.Header.Set("Authorization", "Bearer "+kc.token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", path, resp.Status, body)
	}
	var l struct {
		Items []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(body, &l); err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	return l.Items, nil
}
