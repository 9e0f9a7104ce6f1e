package agent

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// getProbe asks the agent's metrics listener at addr for path and returns
// the status code and the decoded answer.
func getProbe(t *testing.T, addr, path string) (int, probeResult) {
	t.Helper()
	resp, err := http.Get("http://" + addr + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	var res probeResult
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&res))
	return resp.StatusCode, res
}

// TestProbesOnMetricsListener: /readyz and /livez on the metrics listener
// answer as `kvipam-agent health` and `health --live` do. An agent that
// cannot restore a block holding a pod's address (another node's claim
// over it) is live and not ready, saying why; once the claim goes it is ready; once its socket is
// gone it is neither.
func TestProbesOnMetricsListener(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	block, _ := plantForeignClaim(t, cli)
	cfg := testConfig(t, e)
	cfg.MetricsAddr = freeAddr(t)
	ta := startAgent(t, cfg, Options{})

	code, res := getProbe(t, cfg.MetricsAddr, "/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.False(t, res.Ready)
	require.Contains(t, res.Error, "intruder")
	code, res = getProbe(t, cfg.MetricsAddr, "/livez")
	require.Equal(t, http.StatusOK, code, res.Error)
	require.Equal(t, "node-1", res.Node)

	_, err := cli.Delete(ctx, etcdstore.ClaimKey(testPool.Name, block))
	require.NoError(t, err)
	require.NoError(t, waitReady(ta.c, time.Minute), "the agent restores once it can re-claim its block")
	code, res = getProbe(t, cfg.MetricsAddr, "/readyz")
	require.Equal(t, http.StatusOK, code, res.Error)
	require.True(t, res.Ready)

	require.NoError(t, os.Remove(cfg.Socket))
	for _, path := range []string{"/livez", "/readyz"} {
		code, res = getProbe(t, cfg.MetricsAddr, path)
		require.Equal(t, http.StatusServiceUnavailable, code, path)
		require.Contains(t, res.Error, cfg.Socket, path)
	}
	resp, err := http.Post("http://"+cfg.MetricsAddr+"/readyz", "text/plain", nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
}
