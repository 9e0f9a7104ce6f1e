package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/e2e/cluster"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// TestClusterPrefixRole runs the agent and kvipamctl as processes against a
// 3-member etcd cluster (separate processes, mTLS, auth on) with a user
// whose role grants read and write on /kvipam/ only: over a client
// certificate (the CN is the user) and with a user name and password. A
// client without a certificate, and a user without the role, are refused
// at start with a message naming the cause and a non-zero exit.
func TestClusterPrefixRole(t *testing.T) {
	ctx := context.Background()
	c := cluster.Start(t, cluster.Options{})
	require.NoError(t, c.EnableAuth(ctx))
	role := cluster.Role{Name: "kvipam", Prefix: "/kvipam/"}
	require.NoError(t, c.AddUser(ctx, "kvipam", "", role))
	require.NoError(t, c.AddUser(ctx, "kvipam-pw", "s3cret", role))
	require.NoError(t, c.AddUser(ctx, "norole", ""))
	files := func(user string) cluster.ClientFiles {
		f, err := c.ClientConfig(user)
		require.NoError(t, err)
		return f
	}
	eps := strings.Join(c.Endpoints(), ",")
	host := nstest.NewNS(t) // the agent manages pod interfaces there, never the host's
	kvipamctl := buildKvipamctl(t)

	// agentArgs are an agent's flags for node, as user (cert) or with a
	// password; transport is the certificate the TLS connection uses.
	agentArgs := func(node string, transport cluster.ClientFiles, user, password string) ([]string, string) {
		sockDir, err := os.MkdirTemp("", "kvipam-sock-")
		require.NoError(t, err)
		t.Cleanup(func() { os.RemoveAll(sockDir) })
		socket := filepath.Join(sockDir, "agent.sock")
		args := []string{"--netns", host.Path(), "--node", node, "--state-dir", t.TempDir(), "--socket", socket,
			"--etcd-endpoints", eps, "--etcd-cacert", transport.CAFile, "--etcd-dial-timeout", "3s",
			"--pool", "default=10.93.0.0/24", "--block-size-v4", "28", "--datapath", "routes", "--metrics-addr", "",
			"--mtu", "1500", "--routing", "none"}
		if transport.CertFile != "" {
			args = append(args, "--etcd-cert", transport.CertFile, "--etcd-key", transport.KeyFile)
		}
		if user != "" {
			args = append(args, "--etcd-user", user, "--etcd-password", password)
		}
		return args, socket
	}
	root := c.Client(t, cluster.RootUser)
	for _, tc := range []struct {
		name, node     string
		transport      cluster.ClientFiles
		user, password string
		ctl            []string
	}{
		{"client certificate", "node-cert", files("kvipam"), "", "", nil},
		// The TLS certificate names a user without the role: only the
		// password identifies the agent as kvipam-pw.
		{"user and password", "node-pw", files("norole"), "kvipam-pw", "s3cret", []string{"--user", "kvipam-pw"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args, socket := agentArgs(tc.node, tc.transport, tc.user, tc.password)
			cmd := exec.Command(buildAgent(t), args...)
			cmd.Stderr = &testLog{t: t}
			require.NoError(t, cmd.Start())
			t.Cleanup(func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait() })
			ac := client.New(socket, 5*time.Second)
			require.Eventually(t, func() bool {
				st, err := ac.Status(ctx)
				return err == nil && st.Ready
			}, 60*time.Second, 50*time.Millisecond, "the agent becomes ready with a role on /kvipam/ only")
			o := api.Owner{ContainerID: "ctr-" + tc.node, IfName: "eth0"}
			r, err := ac.Allocate(ctx, api.AllocateRequest{Owner: o, Permanent: true})
			require.NoError(t, err)
			resp, err := root.Get(ctx, etcdstore.AllIPsPrefix(), clientv3.WithPrefix())
			require.NoError(t, err)
			require.Contains(t, keysOf(resp), etcdstore.IPKey("default", r.IPs[0].Block, r.IPs[0].Address.Addr()))

			ctlArgs := append([]string{"ip", "list", "--node", tc.node, "--endpoints", eps, "--cacert", tc.transport.CAFile,
				"--cert", tc.transport.CertFile, "--key", tc.transport.KeyFile}, tc.ctl...)
			ctl := exec.Command(kvipamctl, ctlArgs...)
			ctl.Env = append(os.Environ(), "KVIPAM_ETCD_PASSWORD="+tc.password)
			out, err := ctl.CombinedOutput()
			require.NoError(t, err, "kvipamctl with the prefix role: %s", out)
			require.Contains(t, string(out), r.IPs[0].Address.Addr().String())
		})
	}

	t.Run("refusals", func(t *testing.T) {
		noCert := files("kvipam")
		noCert.CertFile, noCert.KeyFile = "", ""
		args, _ := agentArgs("node-nocert", noCert, "", "")
		out, code := runAgent(t, args, nil)
		require.NotZero(t, code, out)
		require.Contains(t, out, "etcd requires a client certificate and none is configured", "the agent names the cause")

		args, _ = agentArgs("node-norole", files("norole"), "", "")
		out, code = runAgent(t, args, nil)
		require.NotZero(t, code, out)
		require.Contains(t, out, `norole`, "the refusal names the user")
		require.Contains(t, out, `may not read /kvipam/v1/health`)
		require.Contains(t, out, "permission denied")

		nr := files("norole")
		ctl := exec.Command(kvipamctl, "ip", "list", "--endpoints", eps, "--cacert", nr.CAFile, "--cert", nr.CertFile, "--key", nr.KeyFile)
		cout, err := ctl.CombinedOutput()
		require.Error(t, err)
		require.Contains(t, string(cout), "permission denied", "kvipamctl names the cause")
		ctl = exec.Command(kvipamctl, "ip", "list", "--endpoints", eps, "--cacert", nr.CAFile, "--dial-timeout", "2s")
		cout, err = ctl.CombinedOutput()
		require.Error(t, err)
		require.Contains(t, string(cout), "requires a client certificate")
	})
}

func keysOf(resp *clientv3.GetResponse) []string {
	var out []string
	for _, kv := range resp.Kvs {
		out = append(out, string(kv.Key))
	}
	return out
}

// buildKvipamctl builds kvipamctl next to the agent binary.
func buildKvipamctl(t testing.TB) string {
	t.Helper()
	bin := filepath.Join(filepath.Dir(buildAgent(t)), "kvipamctl")
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	out, err := exec.Command("go", "build", "-o", bin, "../kvipamctl").CombinedOutput()
	require.NoError(t, err, string(out))
	return bin
}
