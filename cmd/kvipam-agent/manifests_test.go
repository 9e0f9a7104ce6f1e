package main

import (
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/kvipam/kvipam/cni"
)

// TestManifestsDecodeStrict decodes every manifest in deploy/kubernetes
// into the Kubernetes API types, unknown fields being an error, and checks
// that the DaemonSet mounts what the agent it runs reads: the agent's
// configuration from the ConfigMap loads, and its socket, state, bpffs and
// etcd certificate paths, the conflist the installer installs and the
// host CNI directories are all mounted, from the right volumes; no
// container needs a shell; the ServiceAccount grants nothing.
func TestManifestsDecodeStrict(t *testing.T) {
	files, err := filepath.Glob("../../deploy/kubernetes/*.yaml")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	var (
		ds  *appsv1.DaemonSet
		cm  *corev1.ConfigMap
		sa  *corev1.ServiceAccount
		sec *corev1.Secret
	)
	for _, f := range files {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		for i, doc := range strings.Split(string(raw), "\n---\n") {
			var tm metav1.TypeMeta
			require.NoError(t, yaml.Unmarshal([]byte(doc), &tm), "%s #%d", f, i)
			var obj any
			switch tm.Kind {
			case "DaemonSet":
				ds = &appsv1.DaemonSet{}
				obj = ds
			case "ConfigMap":
				cm = &corev1.ConfigMap{}
				obj = cm
			case "ServiceAccount":
				sa = &corev1.ServiceAccount{}
				obj = sa
			case "Secret":
				sec = &corev1.Secret{}
				obj = sec
			default:
				t.Fatalf("%s #%d: kind %q not checked by this test", f, i, tm.Kind)
			}
			require.NoError(t, yaml.UnmarshalStrict([]byte(doc), obj), "%s #%d (%s): strict decode", f, i, tm.Kind)
		}
	}
	require.NotNil(t, ds, "a DaemonSet")
	require.NotNil(t, cm, "a ConfigMap")
	require.NotNil(t, sa, "a ServiceAccount")
	require.NotNil(t, sec, "an example Secret")

	spec := ds.Spec.Template.Spec
	require.Equal(t, sa.Name, spec.ServiceAccountName)
	require.False(t, *sa.AutomountServiceAccountToken, "no API token: the agent never calls the API server")
	require.False(t, *spec.AutomountServiceAccountToken)
	require.True(t, spec.HostNetwork)
	require.Equal(t, "system-node-critical", spec.PriorityClassName)
	require.Contains(t, spec.Tolerations, corev1.Toleration{Operator: corev1.TolerationOpExists}, "runs on every node, tainted or not")
	require.Equal(t, appsv1.RollingUpdateDaemonSetStrategyType, ds.Spec.UpdateStrategy.Type)

	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	// mountOf finds the mount of c that holds file p (a path in the
	// container) and returns it with its volume.
	mountOf := func(c corev1.Container, p string) (corev1.VolumeMount, corev1.Volume) {
		t.Helper()
		for _, m := range c.VolumeMounts {
			if p == m.MountPath || strings.HasPrefix(p, strings.TrimSuffix(m.MountPath, "/")+"/") {
				v, ok := volumes[m.Name]
				require.True(t, ok, "volume %s", m.Name)
				return m, v
			}
		}
		t.Fatalf("container %s: nothing mounted at %s", c.Name, p)
		return corev1.VolumeMount{}, corev1.Volume{}
	}
	hostPathOf := func(c corev1.Container, p string) string {
		m, v := mountOf(c, p)
		require.NotNil(t, v.HostPath, "%s is a host directory", p)
		return path.Join(v.HostPath.Path, strings.TrimPrefix(p, m.MountPath))
	}
	image := spec.Containers[0].Image
	mk, err := os.ReadFile("../../Makefile")
	require.NoError(t, err)
	require.Contains(t, string(mk), "\nIMAGE ?= "+image+"\n", "the DaemonSet runs the image make image tags")
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		require.Equal(t, image, c.Image, "one image")
		require.NotContains(t, strings.Join(c.Command, " "), "/bin/sh", "the image has no shell")
	}
	flagOf := func(args []string, name string) string {
		i := slices.Index(args, name)
		require.GreaterOrEqual(t, i, 0, "%s in %v", name, args)
		return args[i+1]
	}

	// The agent: its configuration comes from the ConfigMap and loads.
	agentC := spec.Containers[0]
	confPath := flagOf(agentC.Command, "--config")
	m, v := mountOf(agentC, confPath)
	require.NotNil(t, v.ConfigMap)
	require.Equal(t, cm.Name, v.ConfigMap.Name)
	conf := filepath.Join(t.TempDir(), "agent.yaml")
	require.NoError(t, os.WriteFile(conf, []byte(cm.Data[m.SubPath]), 0o600))
	cfg, err := loadConfig([]string{"--config", conf}, env(map[string]string{"KVIPAM_NODE": "node-1"}))
	require.NoError(t, err, "the ConfigMap's agent.yaml loads")

	// What it reads and writes is mounted: the host's, where the plugins
	// and the next agent find it.
	require.Equal(t, "/run/kvipam/agent.sock", hostPathOf(agentC, cfg.Socket))
	require.Equal(t, "/var/lib/kvipam", hostPathOf(agentC, cfg.StateDir))
	require.True(t, strings.HasPrefix(hostPathOf(agentC, cfg.BPFPinDir), "/sys/fs/bpf/"))
	bpf, _ := mountOf(agentC, cfg.BPFPinDir)
	require.NotNil(t, bpf.MountPropagation, "pins must reach the host")
	for _, f := range []string{cfg.Etcd.CAFile, cfg.Etcd.CertFile, cfg.Etcd.KeyFile} {
		_, v := mountOf(agentC, f)
		require.NotNil(t, v.Secret, "%s comes from the Secret", f)
		require.Equal(t, sec.Name, v.Secret.SecretName)
		require.Contains(t, sec.StringData, path.Base(f), "the Secret has %s", path.Base(f))
	}
	for _, p := range []*corev1.Probe{agentC.ReadinessProbe, agentC.LivenessProbe} {
		require.NotNil(t, p)
		require.Equal(t, cfg.Socket, flagOf(p.Exec.Command, "--socket"))
		require.Equal(t, "health", p.Exec.Command[1])
	}

	// The installer: the host CNI directories, and the conflist from the
	// ConfigMap, which points the plugin at the agent's socket and a DEL
	// queue in the agent's state directory.
	inst := spec.InitContainers[0]
	require.Equal(t, "install-cni", inst.Command[1])
	require.Equal(t, "/opt/cni/bin", hostPathOf(inst, flagOf(inst.Command, "--bin-dir")))
	require.Equal(t, "/etc/cni/net.d", hostPathOf(inst, flagOf(inst.Command, "--conf-dir")))
	cl, v := mountOf(inst, flagOf(inst.Command, "--conflist"))
	require.NotNil(t, v.ConfigMap)
	list, err := libcni.ConfListFromBytes([]byte(cm.Data[cl.SubPath]))
	require.NoError(t, err)
	require.Equal(t, "kvipam", list.Plugins[0].Network.Type)
	kc, err := libcni.InjectConf(list.Plugins[0], map[string]any{"name": list.Name, "cniVersion": list.CNIVersion})
	require.NoError(t, err)
	pc, err := cni.ParseConfig(kc.Bytes)
	require.NoError(t, err)
	require.Equal(t, cfg.Socket, pc.Socket)
	require.True(t, strings.HasPrefix(pc.DelQueueDir, cfg.StateDir+"/"), "the DEL queue %s is in the agent's state directory", pc.DelQueueDir)
}
