package main

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/kvipam/kvipam/internal/tools/ociimage"
)

type options struct {
	out, ref, conflist string
	// ldflags are added to the binaries' -ldflags (the version and
	// commit of internal/foundation/buildinfo).
	ldflags string
}

// binaries are the image's programs: go build targets, in /usr/local/bin.
var binaries = []string{
	"github.com/kvipam/kvipam/cmd/kvipam-agent",
	"github.com/kvipam/kvipam/cmd/kvipam",
	"github.com/kvipam/kvipam/cmd/kvipam-ipam",
	"github.com/kvipam/kvipam/cmd/kvipamctl",
	"github.com/containernetworking/plugins/plugins/main/loopback",
}

func build(o options) (v1.Hash, error) {
	tmp, err := os.MkdirTemp("", "kvipam-image-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(tmp)
	args := append([]string{"build", "-trimpath", "-ldflags", strings.TrimSpace("-s -w -buildid= " + o.ldflags), "-o", tmp + "/"}, binaries...)
	cmd := exec.Command("go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	if out, err := cmd.CombinedOutput(); err != nil {
		return v1.Hash{}, fmt.Errorf("go build: %w\n%s", err, out)
	}
	spec := ociimage.Spec{Ref: o.ref, Entrypoint: []string{"/usr/local/bin/kvipam-agent"}, Env: []string{"PATH=/usr/local/bin"}}
	for _, b := range binaries {
		name := path.Base(b)
		data, err := os.ReadFile(filepath.Join(tmp, name))
		if err != nil {
			return v1.Hash{}, err
		}
		spec.Files = append(spec.Files, ociimage.File{Path: "usr/local/bin/" + name, Data: data, Mode: 0o755})
	}
	conf, err := os.ReadFile(o.conflist)
	if err != nil {
		return v1.Hash{}, err
	}
	spec.Files = append(spec.Files, ociimage.File{Path: "etc/kvipam/10-kvipam.conflist", Data: conf, Mode: 0o644})
	return ociimage.Write(spec, o.out)
}
