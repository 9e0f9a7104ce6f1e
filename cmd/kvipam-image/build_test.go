package main

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/stretchr/testify/require"
)

// TestImageReproducible builds the image twice: the same digest and the
// same archive bytes. The archive is an OCI layout naming the reference;
// the image holds the five binaries and the conflist, and no shell.
func TestImageReproducible(t *testing.T) {
	if testing.Short() {
		t.Skip("builds every binary: not in -short")
	}
	dir := t.TempDir()
	o := options{ref: "ghcr.io/kvipam/kvipam:test", conflist: "../../deploy/cni/10-kvipam.conflist"}
	o.out = filepath.Join(dir, "a.tar")
	d1, err := build(o)
	require.NoError(t, err)
	o.out = filepath.Join(dir, "b.tar")
	d2, err := build(o)
	require.NoError(t, err)
	require.Equal(t, d1, d2, "the same sources give the same digest")
	a, err := os.ReadFile(filepath.Join(dir, "a.tar"))
	require.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(dir, "b.tar"))
	require.NoError(t, err)
	require.True(t, bytes.Equal(a, b), "and the same archive")

	oci := filepath.Join(dir, "oci")
	untar(t, a, oci)
	p, err := layout.FromPath(oci)
	require.NoError(t, err)
	idx, err := p.ImageIndex()
	require.NoError(t, err)
	man, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, man.Manifests, 1)
	require.Equal(t, d1, man.Manifests[0].Digest)
	require.Equal(t, o.ref, man.Manifests[0].Annotations["org.opencontainers.image.ref.name"])
	img, err := p.Image(d1)
	require.NoError(t, err)
	cfg, err := img.ConfigFile()
	require.NoError(t, err)
	require.Equal(t, []string{"/usr/local/bin/kvipam-agent"}, cfg.Config.Entrypoint)
	layers, err := img.Layers()
	require.NoError(t, err)
	require.Len(t, layers, 1)
	rc, err := layers[0].Uncompressed()
	require.NoError(t, err)
	defer rc.Close()
	var names []string
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		if h.Typeflag == tar.TypeReg {
			names = append(names, h.Name)
		}
	}
	require.ElementsMatch(t, []string{"usr/local/bin/kvipam-agent", "usr/local/bin/kvipam", "usr/local/bin/kvipam-ipam",
		"usr/local/bin/kvipamctl", "usr/local/bin/loopback", "etc/kvipam/10-kvipam.conflist"}, names)
	for _, n := range names {
		require.False(t, strings.HasSuffix(n, "/sh"), "no shell: %s", n)
	}
}

func untar(t *testing.T, data []byte, dir string) {
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
