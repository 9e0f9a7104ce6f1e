// Package ociimage writes a container image as an OCI image archive (an
// OCI layout in a tar file) from files in memory, with go-containerregistry:
// one layer on an empty base, no daemon, no registry. It is reproducible:
// file times, owners and order are fixed, so the same files give the same
// digest and the same archive bytes.
package ociimage

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// File is one file of the image: a path without a leading slash.
type File struct {
	Path string
	Data []byte
	Mode int64
}

// Spec is an image.
type Spec struct {
	Files      []File
	Entrypoint []string
	Env        []string
	// Ref is the reference the archive records (containerd's import
	// names the image after it).
	Ref string
}

// epoch is every file's and the image's time.
var epoch = time.Unix(0, 0).UTC()

// Write writes s as an OCI archive at out and returns the image digest.
func Write(s Spec, out string) (v1.Hash, error) {
	files, modes := map[string][]byte{}, map[string]int64{}
	for _, f := range s.Files {
		files[f.Path], modes[f.Path] = f.Data, f.Mode
	}
	layerTar, err := tarFiles(files, modes)
	if err != nil {
		return v1.Hash{}, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil })
	if err != nil {
		return v1.Hash{}, err
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{Layer: layer, History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: "ociimage"}})
	if err != nil {
		return v1.Hash{}, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return v1.Hash{}, err
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture, cfg.OS = "amd64", "linux"
	cfg.Created = v1.Time{Time: epoch}
	cfg.Config.Entrypoint, cfg.Config.Env = s.Entrypoint, s.Env
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return v1.Hash{}, err
	}
	if img, err = mutate.CreatedAt(img, v1.Time{Time: epoch}); err != nil {
		return v1.Hash{}, err
	}
	digest, err := img.Digest()
	if err != nil {
		return v1.Hash{}, err
	}
	tmp, err := os.MkdirTemp("", "ociimage-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(tmp)
	p, err := layout.Write(tmp, empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": s.Ref,
		"io.containerd.image.name":          s.Ref,
	})); err != nil {
		return v1.Hash{}, fmt.Errorf("write layout: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return v1.Hash{}, err
	}
	if err := tarDir(tmp, out); err != nil {
		return v1.Hash{}, err
	}
	return digest, nil
}

// tarFiles is a tar of files (with their parent directories), in name
// order, owned by root, at epoch.
func tarFiles(files map[string][]byte, modes map[string]int64) ([]byte, error) {
	names := make([]string, 0, len(files))
	dirs := map[string]bool{}
	for n := range files {
		names = append(names, n)
		for d := path.Dir(n); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	for d := range dirs {
		names = append(names, d+"/")
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		h := &tar.Header{Name: n, ModTime: epoch, Uname: "root", Gname: "root", Format: tar.FormatPAX}
		if data, ok := files[n]; ok {
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, modes[n], int64(len(data))
			if err := tw.WriteHeader(h); err != nil {
				return nil, err
			}
			if _, err := tw.Write(data); err != nil {
				return nil, err
			}
			continue
		}
		h.Typeflag, h.Mode = tar.TypeDir, 0o755
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), tw.Close()
}

// tarDir writes dir's tree to out as a tar, in name order, at epoch.
func tarDir(dir, out string) error {
	var names []string
	if err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		names = append(names, p)
		return nil
	}); err != nil {
		return err
	}
	sort.Strings(names)
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	for _, p := range names {
		rel, _ := filepath.Rel(dir, p)
		st, err := os.Stat(p)
		if err != nil {
			return err
		}
		h := &tar.Header{Name: filepath.ToSlash(rel), ModTime: epoch, Mode: 0o644, Format: tar.FormatPAX}
		if st.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
			if err := tw.WriteHeader(h); err != nil {
				return err
			}
			continue
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}
