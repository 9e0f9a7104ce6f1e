package cni

import "github.com/containernetworking/cni/pkg/version"

// SupportedVersions are the CNI spec versions both plugins speak. A result
// is always printed in the configuration's cniVersion, because older
// runtimes (containerd 1.6) cannot parse newer results.
var SupportedVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// VersionInfo is what the plugins answer to VERSION.
func VersionInfo() version.PluginInfo { return version.PluginSupports(SupportedVersions...) }
