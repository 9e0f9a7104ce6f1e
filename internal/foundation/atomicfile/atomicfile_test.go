package atomicfile_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/internal/foundation/atomicfile"
)

// TestWriteReplacesWhole: Write and Replace (which syncs nothing) each
// replace the file whole, with its mode, and leave no temporary file.
func TestWriteReplacesWhole(t *testing.T) {
	for name, write := range map[string]func(dir, name string, data []byte, perm os.FileMode) error{
		"Write": atomicfile.Write, "Replace": atomicfile.Replace,
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, write(dir, "rec.json", []byte(`{"v":1}`), 0o600))
			require.NoError(t, write(dir, "rec.json", []byte(`{"v":22}`), 0o600))
			got, err := os.ReadFile(filepath.Join(dir, "rec.json"))
			require.NoError(t, err)
			require.Equal(t, `{"v":22}`, string(got))
			fi, err := os.Stat(filepath.Join(dir, "rec.json"))
			require.NoError(t, err)
			require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
			entries, err := os.ReadDir(dir)
			require.NoError(t, err)
			require.Len(t, entries, 1, "no temporary file left")

			require.Error(t, write(filepath.Join(dir, "missing"), "x", nil, 0o600))
		})
	}
}
