package cni

import (
	"fmt"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
)

// parsePrevResult turns a configuration's prevResult into a current
// (1.x) result. libcni's converters dereference list entries without a
// nil check, so null entries are refused first; a panic they might still
// raise on odd input becomes a decoding error, never a crash.
func parsePrevResult(cniVersion string, raw map[string]any) (res *current.Result, err error) {
	for _, key := range []string{"interfaces", "ips", "routes"} {
		if list, ok := raw[key].([]any); ok {
			for i, v := range list {
				if v == nil {
					return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode prevResult: %s[%d] is null", key, i))
				}
			}
		}
	}
	defer func() {
		if p := recover(); p != nil {
			res, err = nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode prevResult: %v", p))
		}
	}()
	// ParsePrevResult edits the map it is given.
	cp := make(map[string]any, len(raw))
	for k, v := range raw {
		cp[k] = v
	}
	pc := &types.PluginConf{CNIVersion: cniVersion, RawPrevResult: cp}
	if err := version.ParsePrevResult(pc); err != nil {
		return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode prevResult: %w", err))
	}
	res, err = current.NewResultFromResult(pc.PrevResult)
	if err != nil {
		return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("convert prevResult: %w", err))
	}
	for i, ipc := range res.IPs {
		if ipc.Address.IP == nil {
			return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode prevResult: ips[%d] has no address", i))
		}
		if ipc.Interface != nil && (*ipc.Interface < 0 || *ipc.Interface >= len(res.Interfaces)) {
			return nil, withCode(types.ErrDecodingFailure, fmt.Errorf("decode prevResult: ips[%d] names interface %d of %d", i, *ipc.Interface, len(res.Interfaces)))
		}
	}
	return res, nil
}
