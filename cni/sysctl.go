package cni

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// procSysNet is where the calling thread's network namespace shows its
// sysctls.
const procSysNet = "/proc/sys/net"

// setSysctl writes one sysctl under /proc/sys/net, e.g.
// setSysctl("ipv4/conf/kv123/proxy_arp", "1"). It acts in the network
// namespace of the calling thread.
func setSysctl(key, value string) error {
	if err := os.WriteFile(filepath.Join(procSysNet, key), []byte(value), 0o644); err != nil {
		return fmt.Errorf("set net.%s=%s: %w", filepath.ToSlash(key), value, err)
	}
	return nil
}

// ipv6Enabled reports whether the calling thread's namespace has IPv6.
func ipv6Enabled() bool {
	_, err := os.Stat(filepath.Join(procSysNet, "ipv6"))
	return !errors.Is(err, os.ErrNotExist)
}
