package k8s

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSandboxFailuresFromLog: the churn counts a namespace's failed
// RunPodSandbox attempts in containerd's log and keeps their errors.
func TestSandboxFailuresFromLog(t *testing.T) {
	log := []byte(`time="2026-12-03T13:30:01Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:churn-1,Uid:u1,Namespace:churn-kvipam,Attempt:0,} returns sandbox id \"abc\""
time="2026-12-03T13:30:02Z" level=error msg="RunPodSandbox for &PodSandboxMetadata{Name:churn-2,Uid:u2,Namespace:churn-kvipam,Attempt:0,} failed, error" error="failed to setup network for sandbox \"def\": plugin type=\"kvipam\" failed (add): agent said \"try again\""
time="2026-12-03T13:30:03Z" level=error msg="RunPodSandbox for &PodSandboxMetadata{Name:churn-3,Uid:u3,Namespace:churn-bridge,Attempt:0,} failed, error" error="other"
`)
	n, why := sandboxFailuresIn(log, "churn-kvipam")
	require.Equal(t, 1, n)
	require.Equal(t, []string{`"failed to setup network for sandbox \"def\": plugin type=\"kvipam\" failed (add): agent said \"try again\""`}, why)
	n, _ = sandboxFailuresIn(log, "churn-none")
	require.Zero(t, n)
}
