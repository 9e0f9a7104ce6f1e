package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// renderManifest writes the manifest at in to out with every image of
// ref's repository (any tag or digest) replaced by ref, so that the
// DaemonSet applied runs the image just built: its tag is the build's
// version, and a new build is a new tag, which kubelet pulls.
func renderManifest(in, out, ref string) error {
	repo, ok := repository(ref)
	if !ok {
		return fmt.Errorf("image reference %q has no tag or digest", ref)
	}
	data, err := os.ReadFile(in)
	if err != nil {
		return err
	}
	re := regexp.MustCompile(`(?m)^(\s*(?:-\s+)?image:\s*)` + regexp.QuoteMeta(repo) + `[:@][^\s#]+`)
	if !re.Match(data) {
		return fmt.Errorf("%s names no image of %s", in, repo)
	}
	rendered := re.ReplaceAll(data, []byte("${1}"+strings.ReplaceAll(ref, "$", "$$")))
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	return os.WriteFile(out, rendered, 0o644)
}

// repository is ref without its tag or digest, and whether it had one.
func repository(ref string) (string, bool) {
	if i := strings.Index(ref, "@"); i > 0 {
		return ref[:i], true
	}
	slash := strings.LastIndex(ref, "/")
	if i := strings.LastIndex(ref, ":"); i > slash && i > 0 {
		return ref[:i], true
	}
	return ref, false
}
