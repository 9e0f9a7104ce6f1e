package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// TestImageInstallsChainedPlugins: the image's own kvipam-agent
// install-cni, run from the image's files, installs every plugin that the
// image's conflist and the DaemonSet's ConfigMap conflist chain (a node
// without the standard plugins gets all it needs), and its uninstall-cni
// removes the conflist again.
func TestImageInstallsChainedPlugins(t *testing.T) {
	b, _ := testImage(t)
	files, ok := b.files[runtime.GOARCH]
	if !ok {
		t.Skipf("no %s image", runtime.GOARCH)
	}
	root := t.TempDir()
	for _, f := range files {
		p := filepath.Join(root, f.Path)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, f.Data, os.FileMode(f.Mode)))
	}
	conflists := map[string]string{"image": filepath.Join(root, "etc/kvipam/10-kvipam.conflist")}
	raw, err := os.ReadFile("../../deploy/kubernetes/kvipam-agent.yaml")
	require.NoError(t, err)
	for _, doc := range strings.Split(string(raw), "\n---\n") {
		var cm corev1.ConfigMap
		if yaml.Unmarshal([]byte(doc), &cm) == nil && cm.Kind == "ConfigMap" {
			p := filepath.Join(t.TempDir(), "10-kvipam.conflist")
			require.NoError(t, os.WriteFile(p, []byte(cm.Data["10-kvipam.conflist"]), 0o644))
			conflists["DaemonSet ConfigMap"] = p
		}
	}
	require.Len(t, conflists, 2)
	agentBin := filepath.Join(root, "usr/local/bin/kvipam-agent")
	for name, conflist := range conflists {
		bin, conf := t.TempDir(), t.TempDir()
		out, err := exec.Command(agentBin, "install-cni", "--from", filepath.Join(root, "usr/local/bin"),
			"--bin-dir", bin, "--conf-dir", conf, "--conflist", conflist).CombinedOutput()
		require.NoError(t, err, "%s: install-cni: %s", name, out)
		data, err := os.ReadFile(conflist)
		require.NoError(t, err)
		var list struct {
			Plugins []struct {
				Type string `json:"type"`
			} `json:"plugins"`
		}
		require.NoError(t, json.Unmarshal(data, &list))
		require.NotEmpty(t, list.Plugins)
		for _, p := range list.Plugins {
			require.FileExists(t, filepath.Join(bin, p.Type), "%s: the conflist chains %s", name, p.Type)
		}
		require.FileExists(t, filepath.Join(bin, "loopback"), "containerd's CRI needs loopback")
		require.FileExists(t, filepath.Join(conf, "10-kvipam.conflist"))

		out, err = exec.Command(agentBin, "uninstall-cni", "--bin-dir", bin, "--conf-dir", conf).CombinedOutput()
		require.NoError(t, err, "%s: uninstall-cni: %s", name, out)
		require.NoFileExists(t, filepath.Join(conf, "10-kvipam.conflist"))
	}
}

// TestRenderManifest: make image's copies of the manifests name the image
// it built, in every container, and differ from the originals in nothing
// else.
func TestRenderManifest(t *testing.T) {
	const ref = "ghcr.io/kvipam/kvipam:v1.2.3-4-gabcdef0-dirty"
	for _, in := range []string{"../../deploy/kubernetes/kvipam-agent.yaml", "../../deploy/kubernetes/uninstall/kvipam-uninstall.yaml"} {
		out := filepath.Join(t.TempDir(), filepath.Base(in))
		require.NoError(t, renderManifest(in, out, ref))
		a, err := os.ReadFile(in)
		require.NoError(t, err)
		b, err := os.ReadFile(out)
		require.NoError(t, err)
		al, bl := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
		require.Len(t, bl, len(al))
		changed := 0
		for i := range al {
			if strings.Contains(bl[i], "image:") && !strings.Contains(bl[i], "#") {
				require.Equal(t, "image: "+ref, strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(bl[i]), "-")), "%s:%d", in, i+1)
			}
			if al[i] != bl[i] {
				changed++
			}
		}
		require.GreaterOrEqual(t, changed, 2, "%s: every container's image", in)
	}
	require.Error(t, renderManifest("../../deploy/kubernetes/kvipam-agent.yaml", filepath.Join(t.TempDir(), "x"), "ghcr.io/other/image:1"))
	for ref, repo := range map[string]string{"a/b:1": "a/b", "localhost:5000/a/b:v2": "localhost:5000/a/b", "a/b@sha256:00": "a/b"} {
		got, ok := repository(ref)
		require.True(t, ok)
		require.Equal(t, repo, got)
	}
	_, ok := repository("localhost:5000/a/b")
	require.False(t, ok, "no tag")
}
