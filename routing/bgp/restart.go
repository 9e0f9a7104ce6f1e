package bgp

import (
	"os"
	"path/filepath"
	"strings"
)

// Restarting reports whether this boot's agent ran the speaker before
// (its boot ID is in stateDir): the node's forwarding state then survived,
// and the speaker says so in its OPEN (Options.Restarting: graceful
// restart). It records the boot ID for the next start.
func Restarting(stateDir, bootID string) bool {
	f := filepath.Join(stateDir, "bgp-boot-id")
	b, err := os.ReadFile(f)
	restarting := err == nil && bootID != "" && strings.TrimSpace(string(b)) == bootID
	_ = os.MkdirAll(stateDir, 0o755)
	_ = os.WriteFile(f, []byte(bootID+"\n"), 0o644)
	return restarting
}
