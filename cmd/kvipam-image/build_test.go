package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/stretchr/testify/require"
)

const testRef = "ghcr.io/kvipam/kvipam:test"

// imageOnce builds the image once for the tests that only read it.
var imageOnce struct {
	sync.Once
	dir string
	b   built
	err error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if imageOnce.dir != "" {
		os.RemoveAll(imageOnce.dir)
	}
	os.Exit(code)
}

// testImage is the image built from the default conflist, and the OCI
// layout it holds, unpacked.
func testImage(t testing.TB) (built, layout.Path) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds every binary for two architectures: not in -short")
	}
	imageOnce.Do(func() {
		if imageOnce.dir, imageOnce.err = os.MkdirTemp("", "kvipam-image-test-"); imageOnce.err != nil {
			return
		}
		o := options{ref: testRef, conflist: "../../deploy/cni/10-kvipam.conflist", out: filepath.Join(imageOnce.dir, "image.tar")}
		imageOnce.b, imageOnce.err = build(o)
	})
	require.NoError(t, imageOnce.err)
	data, err := os.ReadFile(filepath.Join(imageOnce.dir, "image.tar"))
	require.NoError(t, err)
	oci := filepath.Join(t.TempDir(), "oci")
	untar(t, data, oci)
	p, err := layout.FromPath(oci)
	require.NoError(t, err)
	return imageOnce.b, p
}

// platformImages are the index's images by architecture, checking that
// the archive holds one index named by the reference.
func platformImages(t testing.TB, p layout.Path, digest v1.Hash, ref string) map[string]v1.Image {
	t.Helper()
	top, err := p.ImageIndex()
	require.NoError(t, err)
	man, err := top.IndexManifest()
	require.NoError(t, err)
	require.Len(t, man.Manifests, 1)
	require.Equal(t, digest, man.Manifests[0].Digest)
	require.True(t, man.Manifests[0].MediaType.IsIndex(), "one index: %s", man.Manifests[0].MediaType)
	require.Equal(t, ref, man.Manifests[0].Annotations["org.opencontainers.image.ref.name"])
	idx, err := top.ImageIndex(digest)
	require.NoError(t, err)
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	out := map[string]v1.Image{}
	for _, d := range im.Manifests {
		require.NotNil(t, d.Platform)
		require.Equal(t, "linux", d.Platform.OS)
		img, err := idx.Image(d.Digest)
		require.NoError(t, err)
		out[d.Platform.Architecture] = img
	}
	return out
}

// TestImageReproducible builds the image twice: the same digest and the
// same archive bytes. The archive is an OCI layout naming the reference;
// the image holds the binaries and the conflist, and no shell.
func TestImageReproducible(t *testing.T) {
	if testing.Short() {
		t.Skip("builds every binary: not in -short")
	}
	dir := t.TempDir()
	o := options{ref: testRef, conflist: "../../deploy/cni/10-kvipam.conflist", archs: []string{runtime.GOARCH}}
	o.out = filepath.Join(dir, "a.tar")
	b1, err := build(o)
	require.NoError(t, err)
	o.out = filepath.Join(dir, "b.tar")
	b2, err := build(o)
	require.NoError(t, err)
	require.Equal(t, b1.digest, b2.digest, "the same sources give the same digest")
	a, err := os.ReadFile(filepath.Join(dir, "a.tar"))
	require.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(dir, "b.tar"))
	require.NoError(t, err)
	require.True(t, bytes.Equal(a, b), "and the same archive")

	oci := filepath.Join(dir, "oci")
	untar(t, a, oci)
	p, err := layout.FromPath(oci)
	require.NoError(t, err)
	img := platformImages(t, p, b1.digest, o.ref)[runtime.GOARCH]
	require.NotNil(t, img)
	cfg, err := img.ConfigFile()
	require.NoError(t, err)
	require.Equal(t, []string{"/usr/local/bin/kvipam-agent"}, cfg.Config.Entrypoint)
	layers, err := img.Layers()
	require.NoError(t, err)
	require.Len(t, layers, 1)
	var names []string
	for _, h := range layerHeaders(t, layers[0]) {
		if h.Typeflag == tar.TypeReg {
			names = append(names, h.Name)
		}
	}
	require.ElementsMatch(t, []string{"usr/local/bin/kvipam-agent", "usr/local/bin/kvipam", "usr/local/bin/kvipam-ipam",
		"usr/local/bin/kvipamctl", "usr/local/bin/loopback", "usr/local/bin/portmap", "usr/local/bin/bandwidth",
		"etc/kvipam/10-kvipam.conflist"}, names)
	for _, n := range names {
		require.False(t, strings.HasSuffix(n, "/sh"), "no shell: %s", n)
	}
}

// TestImageMultiArch: make image's archive is one index with a linux
// image for amd64 and one for arm64, each configured for its architecture
// and holding binaries of that machine.
func TestImageMultiArch(t *testing.T) {
	b, p := testImage(t)
	images := platformImages(t, p, b.digest, testRef)
	require.ElementsMatch(t, []string{"amd64", "arm64"}, slices.Collect(mapKeys(images)))
	machine := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	for arch, img := range images {
		cfg, err := img.ConfigFile()
		require.NoError(t, err)
		require.Equal(t, arch, cfg.Architecture)
		require.Equal(t, "linux", cfg.OS)
		for _, f := range b.files[arch] {
			if !strings.HasPrefix(f.Path, "usr/local/bin/") {
				continue
			}
			e, err := elf.NewFile(bytes.NewReader(f.Data))
			require.NoError(t, err, "%s %s", arch, f.Path)
			require.Equal(t, machine[arch], e.Machine, "%s %s", arch, f.Path)
		}
	}
}

// TestImageLayersStrictTar reads every layer of every architecture's
// image with strict readers, GNU tar (listing and extracting) and
// Python's tarfile, not Go's lenient one: each must read it without
// complaint and see every file at its source's size and content.
func TestImageLayersStrictTar(t *testing.T) {
	if _, err := exec.LookPath("tar"); err != nil {
		t.Skip("no GNU tar")
	}
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	b, p := testImage(t)
	for arch, img := range platformImages(t, p, b.digest, testRef) {
		want := map[string][]byte{}
		for _, f := range b.files[arch] {
			want[f.Path] = f.Data
		}
		layers, err := img.Layers()
		require.NoError(t, err)
		require.Len(t, layers, 1)
		rc, err := layers[0].Uncompressed()
		require.NoError(t, err)
		raw, err := io.ReadAll(rc)
		require.NoError(t, err)
		require.NoError(t, rc.Close())
		dir := t.TempDir()
		file := filepath.Join(dir, "layer.tar")
		require.NoError(t, os.WriteFile(file, raw, 0o644))

		// GNU tar's listing: mode owner size date time name.
		var stdout, stderr bytes.Buffer
		cmd := exec.Command("tar", "-tvf", file)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		require.NoError(t, cmd.Run(), "%s: tar -tvf: %s", arch, stderr.String())
		require.Empty(t, stderr.String(), "%s: tar -tvf complains", arch)
		got := map[string]int{}
		for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
			f := strings.Fields(line)
			require.Len(t, f, 6, "%s: tar -tvf line %q", arch, line)
			if !strings.HasPrefix(f[0], "-") {
				continue
			}
			n, err := strconv.Atoi(f[2])
			require.NoError(t, err)
			got[f[5]] = n
		}
		require.Equal(t, sizes(want), got, "%s: GNU tar's listing", arch)

		// GNU tar's extraction: every file whole.
		out := filepath.Join(dir, "x")
		require.NoError(t, os.MkdirAll(out, 0o755))
		stderr.Reset()
		cmd = exec.Command("tar", "-xf", file, "-C", out)
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Run(), "%s: tar -xf: %s", arch, stderr.String())
		require.Empty(t, stderr.String(), "%s: tar -xf complains", arch)
		for name, data := range want {
			x, err := os.ReadFile(filepath.Join(out, name))
			require.NoError(t, err)
			require.Equal(t, len(data), len(x), "%s: %s extracted by GNU tar", arch, name)
			require.True(t, bytes.Equal(data, x), "%s: %s extracted by GNU tar is its source", arch, name)
		}

		// Python's tarfile, reading every member's data to its end.
		stdout.Reset()
		stderr.Reset()
		cmd = exec.Command(python, "-c", `
import json, sys, tarfile
out = {}
with tarfile.open(sys.argv[1], "r:") as tf:
    for m in tf:
        if m.isfile():
            out[m.name] = [m.size, len(tf.extractfile(m).read())]
print(json.dumps(out))
`, file)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		require.NoError(t, cmd.Run(), "%s: python tarfile: %s", arch, stderr.String())
		var py map[string][2]int
		require.NoError(t, json.Unmarshal(stdout.Bytes(), &py))
		got = map[string]int{}
		for name, s := range py {
			require.Equal(t, s[0], s[1], "%s: %s: tarfile reads all its data", arch, name)
			got[name] = s[1]
		}
		require.Equal(t, sizes(want), got, "%s: Python's tarfile", arch)
	}
}

func sizes(files map[string][]byte) map[string]int {
	out := map[string]int{}
	for n, d := range files {
		out[n] = len(d)
	}
	return out
}

func mapKeys[K comparable, V any](m map[K]V) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

func layerHeaders(t testing.TB, l v1.Layer) []*tar.Header {
	t.Helper()
	rc, err := l.Uncompressed()
	require.NoError(t, err)
	defer rc.Close()
	var out []*tar.Header
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		require.NoError(t, err)
		out = append(out, h)
	}
}

func untar(t testing.TB, data []byte, dir string) {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return
		}
		require.NoError(t, err)
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if h.Typeflag == tar.TypeDir {
			require.NoError(t, os.MkdirAll(p, 0o755))
			continue
		}
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		b, err := io.ReadAll(tr)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(p, b, 0o644))
	}
}
