package cni

import (
	"fmt"
	"strings"
	"unicode"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/kvipam/kvipam/agent/api"
)

// Args are the CNI_ARGS a Kubernetes runtime sends. Every field may be
// empty: ctr and cnitool send none.
type Args struct {
	PodNamespace        string
	PodName             string
	PodInfraContainerID string
	PodUID              string
}

// k8sArgs is the shape types.LoadArgs fills; its fields must be
// encoding.TextUnmarshalers.
type k8sArgs struct {
	types.CommonArgs
	K8S_POD_NAMESPACE          types.UnmarshallableString //nolint:revive // the CNI_ARGS key
	K8S_POD_NAME               types.UnmarshallableString //nolint:revive
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString //nolint:revive
	K8S_POD_UID                types.UnmarshallableString //nolint:revive
}

// maxArgLen bounds each value: Kubernetes names are at most 253 bytes, and
// the values end up in etcd records.
const maxArgLen = 253

// ParseArgs parses CNI_ARGS ("K=V;K2=V2"). Unknown keys are an error
// unless IgnoreUnknown=1 (or true) is among them, as in the spec. Errors
// carry CNI code 4 and name CNI_ARGS.
func ParseArgs(s string) (Args, error) {
	var k k8sArgs
	if err := types.LoadArgs(s, &k); err != nil {
		return Args{}, withCode(types.ErrInvalidEnvironmentVariables, fmt.Errorf("parse CNI_ARGS: %w", err))
	}
	a := Args{
		PodNamespace:        string(k.K8S_POD_NAMESPACE),
		PodName:             string(k.K8S_POD_NAME),
		PodInfraContainerID: string(k.K8S_POD_INFRA_CONTAINER_ID),
		PodUID:              string(k.K8S_POD_UID),
	}
	for _, f := range []struct{ key, v string }{
		{"K8S_POD_NAMESPACE", a.PodNamespace},
		{"K8S_POD_NAME", a.PodName},
		{"K8S_POD_INFRA_CONTAINER_ID", a.PodInfraContainerID},
		{"K8S_POD_UID", a.PodUID},
	} {
		if len(f.v) > maxArgLen {
			return Args{}, withCode(types.ErrInvalidEnvironmentVariables, fmt.Errorf("parse CNI_ARGS: %s is %d bytes long, at most %d allowed", f.key, len(f.v), maxArgLen))
		}
		if i := strings.IndexFunc(f.v, func(r rune) bool { return unicode.IsControl(r) || r == unicode.ReplacementChar }); i >= 0 {
			return Args{}, withCode(types.ErrInvalidEnvironmentVariables, fmt.Errorf("parse CNI_ARGS: %s has a control or invalid character at byte %d", f.key, i))
		}
	}
	return a, nil
}

// owner is the attachment's identity at the agent, with the pod's names
// when the runtime sent them in CNI_ARGS.
func owner(args *skel.CmdArgs, network string) (api.Owner, error) {
	a, err := ParseArgs(args.Args)
	if err != nil {
		return api.Owner{}, err
	}
	return api.Owner{ContainerID: args.ContainerID, IfName: args.IfName, Namespace: a.PodNamespace, Pod: a.PodName, PodUID: a.PodUID, Network: network}, nil
}

// delOwner is a DEL's owner: the attachment, with the pod's names when
// CNI_ARGS carries them (a sticky pod's DEL names its identity with
// them). CNI_ARGS that do not parse are logged, never a failure: a DEL
// must tear down whatever its ADD set up, and such an ADD set up nothing.
func delOwner(args *skel.CmdArgs, network string, log logger) api.Owner {
	o, err := owner(args, network)
	if err != nil {
		log.Warn("DEL with CNI_ARGS kvipam cannot parse; released without the pod's names", "error", err)
		return api.Owner{ContainerID: args.ContainerID, IfName: args.IfName, Network: network}
	}
	return o
}
