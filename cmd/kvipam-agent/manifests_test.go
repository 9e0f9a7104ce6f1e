package main

import (
	"bytes"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/kvipam/kvipam/agent"
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
	ms := loadManifests(t)
	ds, cm, sa, sec := ms.daemonSets["kvipam-agent"], ms.cm, ms.sa, ms.sec
	require.NotNil(t, ds, "the agent's DaemonSet")
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
	cfg, err := loadConfig([]string{"--config", conf}, env(containerEnv(t, agentC)))
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
	// The probes are HTTP, on the metrics listener (the node's address,
	// as the kubelet probes a host-network pod), at its port.
	var metricsPort int32
	for _, p := range agentC.Ports {
		if p.Name == "metrics" {
			metricsPort = p.ContainerPort
		}
	}
	var metricsAddr string
	for _, e := range agentC.Env {
		if e.Name == "KVIPAM_METRICS_ADDR" {
			metricsAddr = e.Value
		}
	}
	require.Equal(t, "$(NODE_IP):"+strconv.Itoa(int(metricsPort)), metricsAddr)
	for p, path := range map[*corev1.Probe]string{agentC.ReadinessProbe: "/readyz", agentC.LivenessProbe: "/livez"} {
		require.NotNil(t, p)
		require.NotNil(t, p.HTTPGet, "an HTTP probe, not an exec")
		require.Equal(t, path, p.HTTPGet.Path)
		require.Equal(t, "metrics", p.HTTPGet.Port.StrVal)
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

// manifests are deploy/kubernetes's objects, decoded strictly.
type manifests struct {
	daemonSets map[string]*appsv1.DaemonSet
	cm         *corev1.ConfigMap
	sa         *corev1.ServiceAccount
	sec        *corev1.Secret
}

func loadManifests(t testing.TB) manifests {
	t.Helper()
	files, err := filepath.Glob("../../deploy/kubernetes/*.yaml")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	uninstallFiles, err := filepath.Glob("../../deploy/kubernetes/uninstall/*.yaml")
	require.NoError(t, err)
	require.NotEmpty(t, uninstallFiles, "an uninstall manifest")
	m := manifests{daemonSets: map[string]*appsv1.DaemonSet{}}
	for _, f := range append(files, uninstallFiles...) {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		for i, doc := range strings.Split(string(raw), "\n---\n") {
			var tm metav1.TypeMeta
			require.NoError(t, yaml.Unmarshal([]byte(doc), &tm), "%s #%d", f, i)
			var obj any
			switch tm.Kind {
			case "DaemonSet":
				obj = &appsv1.DaemonSet{}
			case "ConfigMap":
				m.cm = &corev1.ConfigMap{}
				obj = m.cm
			case "ServiceAccount":
				m.sa = &corev1.ServiceAccount{}
				obj = m.sa
			case "Secret":
				m.sec = &corev1.Secret{}
				obj = m.sec
			default:
				t.Fatalf("%s #%d: kind %q not checked by this test", f, i, tm.Kind)
			}
			require.NoError(t, yaml.UnmarshalStrict([]byte(doc), obj), "%s #%d (%s): strict decode", f, i, tm.Kind)
			if d, ok := obj.(*appsv1.DaemonSet); ok {
				m.daemonSets[d.Name] = d
			}
		}
	}
	return m
}

// Node values the kubelet gives a pod's env through fieldRef.
const (
	testNodeName = "node-1"
	testNodeIP   = "10.1.2.3"
)

// containerEnv is c's environment as the kubelet gives it on node-1
// (10.1.2.3): fieldRefs resolved and $(VAR) references to earlier
// variables expanded.
func containerEnv(t testing.TB, c corev1.Container) map[string]string {
	t.Helper()
	fields := map[string]string{"spec.nodeName": testNodeName, "status.hostIP": testNodeIP}
	out := map[string]string{}
	for _, e := range c.Env {
		if e.ValueFrom != nil {
			require.NotNil(t, e.ValueFrom.FieldRef, "env %s: only fieldRef is modelled", e.Name)
			v, ok := fields[e.ValueFrom.FieldRef.FieldPath]
			require.True(t, ok, "env %s: field %s not modelled", e.Name, e.ValueFrom.FieldRef.FieldPath)
			out[e.Name] = v
			continue
		}
		v := e.Value
		for k, val := range out {
			v = strings.ReplaceAll(v, "$("+k+")", val)
		}
		require.NotContains(t, v, "$(", "env %s: a reference to an unknown or later variable", e.Name)
		out[e.Name] = v
	}
	return out
}

// TestManifestsImageTaggedByBuild: every container of every DaemonSet
// runs one image of kvipam's repository, never a reused tag like :dev
// (kubelet would not pull a rebuild of it again); the image in git is a
// placeholder that make image replaces, in the copies it renders into
// bin/, by the tag it builds: the build's version, git describe --always
// --dirty, as internal/foundation/buildinfo reports it.
func TestManifestsImageTaggedByBuild(t *testing.T) {
	ms := loadManifests(t)
	mk, err := os.ReadFile("../../Makefile")
	require.NoError(t, err)
	makefile := string(mk)
	require.Contains(t, makefile, "\nVERSION ?= $(shell git describe --always --dirty")
	require.Contains(t, makefile, "\nIMAGE ?= $(IMAGE_REPO):$(VERSION)\n", "make image tags the build's version")
	var image string
	for name, ds := range ms.daemonSets {
		spec := ds.Spec.Template.Spec
		for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			if image == "" {
				image = c.Image
			}
			require.Equal(t, image, c.Image, "%s/%s: one image", name, c.Name)
			require.Equal(t, corev1.PullIfNotPresent, c.ImagePullPolicy, "%s/%s: a tag per build, pulled once", name, c.Name)
		}
		require.Contains(t, makefile, strings.TrimPrefix(manifestPath(t, name), "../../"), "make image renders the manifest of %s", name)
	}
	repo, tag, ok := strings.Cut(image, ":")
	require.True(t, ok, "a tag: %s", image)
	require.Contains(t, makefile, "\nIMAGE_REPO ?= "+repo+"\n")
	require.NotContains(t, []string{"dev", "latest"}, tag, "never a tag reused across builds")
}

// manifestPath is the file holding the DaemonSet name.
func manifestPath(t testing.TB, name string) string {
	t.Helper()
	files, err := filepath.Glob("../../deploy/kubernetes/*.yaml")
	require.NoError(t, err)
	more, err := filepath.Glob("../../deploy/kubernetes/uninstall/*.yaml")
	require.NoError(t, err)
	for _, f := range append(files, more...) {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		if strings.Contains(string(raw), "kind: DaemonSet\nmetadata:\n  name: "+name+"\n") {
			return f
		}
	}
	t.Fatalf("no manifest holds the DaemonSet %s", name)
	return ""
}

// agentConfig is the agent's configuration on node-1 as the DaemonSet
// gives it: the ConfigMap's agent.yaml and the container's environment.
func agentConfig(t testing.TB, ms manifests) (agent.Config, corev1.Container) {
	t.Helper()
	c := ms.daemonSets["kvipam-agent"].Spec.Template.Spec.Containers[0]
	conf := filepath.Join(t.TempDir(), "agent.yaml")
	require.NoError(t, os.WriteFile(conf, []byte(ms.cm.Data["agent.yaml"]), 0o600))
	cfg, err := loadConfig([]string{"--config", conf}, env(containerEnv(t, c)))
	require.NoError(t, err)
	return cfg, c
}

// TestManifestsEtcdByAddress: the agent reaches etcd by address: it is a
// host-network pod that runs before any pod has a network, cluster DNS
// included, so a name like etcd-0.etcd would not resolve.
func TestManifestsEtcdByAddress(t *testing.T) {
	cfg, _ := agentConfig(t, loadManifests(t))
	require.NotEmpty(t, cfg.Etcd.Endpoints)
	for _, e := range cfg.Etcd.Endpoints {
		u, err := url.Parse(e)
		require.NoError(t, err)
		_, err = netip.ParseAddr(u.Hostname())
		require.NoError(t, err, "etcd endpoint %s: an address, not a name", e)
	}
}

// TestManifestsAgentPrivileges: the agent is not privileged: it drops
// every capability and adds NET_ADMIN and SYS_ADMIN (docs/kubernetes.md
// says why each); the bpffs mount needs no privileged propagation; every
// container has requests and a memory limit; the metrics listen on the
// node's address, at the port the pod declares, never on every address.
func TestManifestsAgentPrivileges(t *testing.T) {
	ms := loadManifests(t)
	cfg, c := agentConfig(t, ms)
	sc := c.SecurityContext
	require.NotNil(t, sc)
	require.False(t, sc.Privileged != nil && *sc.Privileged, "not privileged")
	require.NotNil(t, sc.Capabilities)
	require.Equal(t, []corev1.Capability{"ALL"}, sc.Capabilities.Drop)
	require.ElementsMatch(t, []corev1.Capability{"NET_ADMIN", "SYS_ADMIN"}, sc.Capabilities.Add)
	for _, m := range c.VolumeMounts {
		if m.MountPropagation != nil {
			require.NotEqual(t, corev1.MountPropagationBidirectional, *m.MountPropagation, "%s: Bidirectional needs a privileged container", m.MountPath)
		}
	}
	for name, ds := range ms.daemonSets {
		spec := ds.Spec.Template.Spec
		for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			require.False(t, c.SecurityContext == nil || c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged, "%s/%s: not privileged", name, c.Name)
			require.False(t, c.Resources.Requests.Cpu().IsZero(), "%s/%s: a CPU request", name, c.Name)
			require.False(t, c.Resources.Requests.Memory().IsZero(), "%s/%s: a memory request", name, c.Name)
			require.False(t, c.Resources.Limits.Memory().IsZero(), "%s/%s: a memory limit", name, c.Name)
		}
	}

	host, port, err := net.SplitHostPort(cfg.MetricsAddr)
	require.NoError(t, err)
	require.Equal(t, testNodeIP, host, "metrics on the node's address")
	var declared int32
	for _, p := range c.Ports {
		if p.Name == "metrics" {
			declared = p.ContainerPort
		}
	}
	require.Equal(t, strconv.Itoa(int(declared)), port, "at the port the pod declares")
	defHost, _, err := net.SplitHostPort(agent.DefaultConfig().MetricsAddr)
	require.NoError(t, err)
	require.True(t, netip.MustParseAddr(defHost).IsLoopback(), "the default is loopback")
}

// TestManifestsUninstallRemovesConflist: what the agent DaemonSet's
// install-cni puts on a node, the uninstall DaemonSet's commands remove:
// the conflist (under the name install-cni gave it) and kvipam's plugins,
// in the host directories both mount; run again, they change nothing.
func TestManifestsUninstallRemovesConflist(t *testing.T) {
	ms := loadManifests(t)
	hostDirs := map[string]string{"/opt/cni/bin": t.TempDir(), "/etc/cni/net.d": t.TempDir()}
	// remap points a container's --bin-dir and --conf-dir, which must be
	// host directories, at this test's copies of them.
	remap := func(ds *appsv1.DaemonSet, c corev1.Container) []string {
		volumes := map[string]corev1.Volume{}
		for _, v := range ds.Spec.Template.Spec.Volumes {
			volumes[v.Name] = v
		}
		args := slices.Clone(c.Command[2:])
		for i := 0; i+1 < len(args); i++ {
			if args[i] != "--bin-dir" && args[i] != "--conf-dir" {
				continue
			}
			var host string
			for _, m := range c.VolumeMounts {
				if m.MountPath == args[i+1] {
					require.NotNil(t, volumes[m.Name].HostPath, "%s %s", c.Name, args[i])
					host = volumes[m.Name].HostPath.Path
				}
			}
			require.Contains(t, hostDirs, host, "%s %s %s", c.Name, args[i], args[i+1])
			args[i+1] = hostDirs[host]
		}
		return args
	}

	agentDS := ms.daemonSets["kvipam-agent"]
	inst := agentDS.Spec.Template.Spec.InitContainers[0]
	require.Equal(t, "install-cni", inst.Command[1])
	args := remap(agentDS, inst)
	conflist := filepath.Join(t.TempDir(), path.Base(args[slices.Index(args, "--conflist")+1]))
	require.NoError(t, os.WriteFile(conflist, []byte(ms.cm.Data["10-kvipam.conflist"]), 0o644))
	args[slices.Index(args, "--conflist")+1] = conflist
	chained, err := conflistPlugins(conflist)
	require.NoError(t, err)
	from := t.TempDir()
	for _, p := range append(chained, "kvipam", "kvipam-ipam", "loopback") {
		require.NoError(t, os.WriteFile(filepath.Join(from, p), []byte("#!binary "+p), 0o755))
	}
	var out, errs bytes.Buffer
	require.Equal(t, 0, runInstall(append(args, "--from", from), &out, &errs), errs.String())
	installed := filepath.Join(hostDirs["/etc/cni/net.d"], path.Base(conflist))
	require.FileExists(t, installed)

	un := ms.daemonSets["kvipam-uninstall"]
	require.NotNil(t, un, "the uninstall DaemonSet")
	spec := un.Spec.Template.Spec
	require.True(t, spec.HostNetwork, "runs on nodes with no pod network")
	require.Contains(t, spec.Tolerations, corev1.Toleration{Operator: corev1.TolerationOpExists}, "on every node, NotReady ones too")
	require.NotEmpty(t, spec.InitContainers, "the removal is done before the pod is Ready")
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		require.Equal(t, "uninstall-cni", c.Command[1], c.Name)
		require.Contains(t, c.SecurityContext.Capabilities.Add, corev1.Capability("NET_ADMIN"), "%s removes routes and the VXLAN device", c.Name)
		require.True(t, slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/sys/fs/bpf" }), "%s sees the host's bpffs", c.Name)
		args := slices.DeleteFunc(remap(un, c), func(a string) bool { return a == "--wait" })
		args = append(args, scratchNodeState(t)...)
		require.Equal(t, 0, runUninstall(args, &out, &errs), "%s: %s", c.Name, errs.String())
		require.NoFileExists(t, installed, "%s removed the conflist", c.Name)
		require.NoFileExists(t, filepath.Join(hostDirs["/opt/cni/bin"], "kvipam"))
		require.NoFileExists(t, filepath.Join(hostDirs["/opt/cni/bin"], "kvipam-ipam"))
	}
	require.Contains(t, spec.Containers[0].Command, "--wait", "the pod stays up, Ready, until deleted")
}

// TestManifestsNeedKubernetes130: docs/kubernetes.md states the oldest
// Kubernetes the manifests need, 1.30, because a container sets
// securityContext.appArmorProfile (a field of 1.30); and since the
// default pool is dual-stack, it names both forwarding sysctls.
func TestManifestsNeedKubernetes130(t *testing.T) {
	ms := loadManifests(t)
	doc, err := os.ReadFile("../../docs/kubernetes.md")
	require.NoError(t, err)
	apparmor := false
	for _, ds := range ms.daemonSets {
		spec := ds.Spec.Template.Spec
		for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			apparmor = apparmor || c.SecurityContext != nil && c.SecurityContext.AppArmorProfile != nil
		}
		apparmor = apparmor || spec.SecurityContext != nil && spec.SecurityContext.AppArmorProfile != nil
	}
	require.True(t, apparmor, "the reason for 1.30 is gone: state the new minimum in docs/kubernetes.md and here")
	require.Contains(t, string(doc), "**Kubernetes 1.30 or later.**")

	cfg, _ := agentConfig(t, ms)
	fams := map[bool]bool{}
	for _, p := range cfg.Pools {
		for _, c := range p.CIDRs {
			fams[c.Addr().Is4()] = true
		}
	}
	require.True(t, fams[true] && fams[false], "the default pool is dual-stack")
	require.Contains(t, string(doc), "net.ipv4.ip_forward = 1")
	require.Contains(t, string(doc), "net.ipv6.conf.all.forwarding = 1")
}
