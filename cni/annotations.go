package cni

import (
	"slices"
	"strings"
	"time"
)

// Pod annotations kvipam reads (through the runtime's
// io.kubernetes.cri.pod-annotations capability).
const (
	AnnotationPool    = "kvipam.io/pool"
	AnnotationIPs     = "kvipam.io/ips"
	AnnotationSticky  = "kvipam.io/sticky"
	AnnotationIPClaim = "kvipam.io/ip-claim"
	// AnnotationMigrationTarget marks the target pod of a live migration
	// of the pod's sticky identity; its value names the migration.
	// KubeVirt's own marker, AnnotationKubeVirtMigration, is read too.
	AnnotationMigrationTarget   = "kvipam.io/migration-target"
	AnnotationKubeVirtMigration = "kubevirt.io/migrationJobName"
)

// applyAnnotations takes the pod's pool (it comes before a namespace
// binding and the configuration's pool) and static addresses (comma
// separated; when the ips capability gives none).
func (c *Config) applyAnnotations(ann map[string]string) error {
	if p, ok := ann[AnnotationPool]; ok {
		if p = strings.TrimSpace(p); p == "" || strings.ContainsAny(p, "/ ") {
			return invalidConf("pod annotation %s %q is not a pool name", AnnotationPool, ann[AnnotationPool])
		}
		c.PodPool = strings.TrimSpace(p)
	}
	if v, ok := ann[AnnotationSticky]; ok {
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if err != nil || d < time.Second {
			return invalidConf("pod annotation %s %q is not a duration of a second or more (e.g. 10m)", AnnotationSticky, v)
		}
		c.Sticky = d
	}
	if v, ok := ann[AnnotationIPClaim]; ok {
		if v = strings.TrimSpace(v); v == "" || strings.ContainsAny(v, "/ ") {
			return invalidConf("pod annotation %s %q is not a name", AnnotationIPClaim, ann[AnnotationIPClaim])
		}
		if c.Sticky == 0 {
			return invalidConf("pod annotation %s needs %s (how long its addresses are kept)", AnnotationIPClaim, AnnotationSticky)
		}
		c.IPClaim = v
	}
	for _, key := range []string{AnnotationMigrationTarget, AnnotationKubeVirtMigration} {
		v, ok := ann[key]
		if !ok || c.Migration != "" {
			continue
		}
		if v = strings.TrimSpace(v); v == "" {
			return invalidConf("pod annotation %s is empty: it names the migration", key)
		}
		if c.Sticky == 0 {
			return invalidConf("pod annotation %s needs %s: only a sticky identity's addresses follow a VM through a live migration", key, AnnotationSticky)
		}
		c.Migration = v
	}
	v, ok := ann[AnnotationIPs]
	if !ok {
		return nil
	}
	ips, err := parseStaticIPs(strings.Split(v, ","), "pod annotation "+AnnotationIPs)
	if err != nil {
		return err
	}
	if len(c.IPs) > 0 && !slices.Equal(ips, c.IPs) {
		return invalidConf("pod annotation %s %q and runtimeConfig.ips %v disagree", AnnotationIPs, v, c.IPs)
	}
	c.IPs = ips
	return nil
}
