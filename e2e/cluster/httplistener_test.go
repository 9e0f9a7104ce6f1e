package cluster_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/kvstore"
)

// TestClusterOwnHTTPListener: with Options.OwnHTTPListener each member's
// HTTP endpoints answer on a URL of their own, its client URL serves only
// gRPC, and kvipam's etcd client (kvstore.Connect, as the agent and
// kvipamctl connect) works through it as before.
func TestClusterOwnHTTPListener(t *testing.T) {
	c := cluster.Start(t, cluster.Options{OwnHTTPListener: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	files, err := c.ClientConfig(cluster.RootUser)
	require.NoError(t, err)
	cli, err := kvstore.Connect(ctx, kvstore.Config{Endpoints: c.Endpoints(), CAFile: files.CAFile, CertFile: files.CertFile, KeyFile: files.KeyFile}, "/own-http-listener/health")
	require.NoError(t, err)
	defer cli.Close()
	_, err = cli.Put(ctx, "/own-http-listener/x", "through grpc-go's own server")
	require.NoError(t, err)
	got, err := cli.Get(ctx, "/own-http-listener/x")
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)

	tc, err := c.TLSConfig(cluster.RootUser)
	require.NoError(t, err)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}, Timeout: 10 * time.Second}
	get := func(url string) (int, []byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return 0, nil, err
		}
		resp, err := hc.Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return resp.StatusCode, body, err
	}
	httpURLs, clientURLs := c.HTTPEndpoints(), c.Endpoints()
	for i := range c.Len() {
		require.NotEqual(t, clientURLs[i], httpURLs[i], "member %d", i)
		code, body, err := get(httpURLs[i] + "/health")
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, code, "member %d: %s", i, body)
		var h struct {
			Health string `json:"health"`
		}
		require.NoError(t, json.Unmarshal(body, &h), "member %d: %s", i, body)
		require.Equal(t, "true", h.Health, "member %d", i)

		// The client URL no longer serves HTTP.
		code, body, err = get(clientURLs[i] + "/health")
		if err == nil {
			require.NotEqual(t, http.StatusOK, code, "member %d: /health answered on the gRPC URL: %s", i, body)
		}
		t.Logf("member %d: /health on the client URL: %d %v", i, code, err)
	}
}
