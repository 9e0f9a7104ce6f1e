package ociimage

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/stretchr/testify/require"
)

// TestWriteIndexWholeLayers: WriteIndex writes one index naming the
// reference, with an image per architecture whose configuration says so,
// and each layer is a whole tar: every file padded, the two end-of-archive
// blocks written, and GNU tar lists it without complaint. Files of sizes
// around a 512-byte block exercise the padding of the last one.
func TestWriteIndexWholeLayers(t *testing.T) {
	files := []File{
		{Path: "a/one", Data: bytes.Repeat([]byte{1}, 1), Mode: 0o644},
		{Path: "a/two", Data: bytes.Repeat([]byte{2}, 511), Mode: 0o644},
		{Path: "z/last", Data: bytes.Repeat([]byte{3}, 513), Mode: 0o755},
	}
	dir := t.TempDir()
	out := filepath.Join(dir, "image.tar")
	digest, err := WriteIndex("example.test/x:1", []Spec{{Arch: "amd64", Files: files}, {Arch: "arm64", Files: files}}, out)
	require.NoError(t, err)
	_, err = WriteIndex("example.test/x:1", []Spec{{Arch: "amd64"}, {}}, filepath.Join(dir, "dup.tar"))
	require.Error(t, err, "two images of one architecture")

	oci := filepath.Join(dir, "oci")
	require.NoError(t, os.MkdirAll(oci, 0o755))
	cmd := exec.Command("tar", "-xf", out, "-C", oci)
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", b)
	require.Empty(t, b, "GNU tar reads the archive without complaint")
	p, err := layout.FromPath(oci)
	require.NoError(t, err)
	top, err := p.ImageIndex()
	require.NoError(t, err)
	man, err := top.IndexManifest()
	require.NoError(t, err)
	require.Len(t, man.Manifests, 1)
	require.Equal(t, digest, man.Manifests[0].Digest)
	require.Equal(t, "example.test/x:1", man.Manifests[0].Annotations["io.containerd.image.name"])
	idx, err := top.ImageIndex(digest)
	require.NoError(t, err)
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, im.Manifests, 2)
	for _, d := range im.Manifests {
		img, err := idx.Image(d.Digest)
		require.NoError(t, err)
		cfg, err := img.ConfigFile()
		require.NoError(t, err)
		require.Equal(t, d.Platform.Architecture, cfg.Architecture)
		layers, err := img.Layers()
		require.NoError(t, err)
		rc, err := layers[0].Uncompressed()
		require.NoError(t, err)
		raw, err := io.ReadAll(rc)
		require.NoError(t, err)
		require.NoError(t, rc.Close())
		require.Zero(t, len(raw)%512, "whole blocks")
		require.GreaterOrEqual(t, len(raw), 1024)
		require.Equal(t, make([]byte, 1024), raw[len(raw)-1024:], "the end-of-archive blocks")
		tr := tar.NewReader(bytes.NewReader(raw))
		sizes := map[string]int64{}
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			require.NoError(t, err)
			if h.Typeflag == tar.TypeReg {
				sizes[h.Name] = h.Size
			}
		}
		require.Equal(t, map[string]int64{"a/one": 1, "a/two": 511, "z/last": 513}, sizes)
		lf := filepath.Join(dir, d.Platform.Architecture+".tar")
		require.NoError(t, os.WriteFile(lf, raw, 0o644))
		b, err := exec.Command("tar", "-tf", lf).CombinedOutput()
		require.NoError(t, err, "%s", b)
		require.NotContains(t, string(b), "tar:", "GNU tar lists the layer without complaint")
	}
}
