package cni

import (
	"errors"
	"fmt"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/client"
)

func TestToCNIError(t *testing.T) {
	exhausted := &api.Error{Code: api.CodeExhausted, Message: "pool default exhausted (ipv4): 64 of 64 blocks claimed", Status: 409}
	tests := []struct {
		name     string
		err      error
		wantCode uint
		wantMsg  string
	}{
		{"agent socket missing", fmt.Errorf("allocate: %w: dial unix: no such file", client.ErrUnreachable), types.ErrTryAgainLater, "kvipam agent unreachable"},
		{"etcd down", fmt.Errorf("allocate: %w", &api.Error{Code: api.CodeTryAgain, Message: "etcd unreachable: context deadline exceeded"}), types.ErrTryAgainLater, "etcd unreachable"},
		{"exhausted", fmt.Errorf("allocate for c1/eth0: %w", exhausted), ErrCodePoolExhausted, "pool default exhausted (ipv4): 64 of 64 blocks claimed"},
		{"ip in use", &api.Error{Code: api.CodeInUse, Message: "10.1.0.7 is held by c9/eth0"}, ErrCodeAddressInUse, "10.1.0.7 is held by c9/eth0"},
		{"bad request", &api.Error{Code: api.CodeBadRequest, Message: `pool "x" is not served by node n1`, Field: "pool"}, types.ErrInvalidNetworkConfig, `pool "x" is not served`},
		{"node name taken", &api.Error{Code: api.CodeNameTaken, Message: `node name "n1" is held by another agent`, Status: 409}, ErrCodeNodeNameTaken, "held by another agent"},
		{"agent internal", &api.Error{Code: api.CodeInternal, Message: "program datapath: boom"}, types.ErrInternal, "program datapath: boom"},
		{"netlink", errors.New("create veth kv1: file exists"), types.ErrInternal, "create veth kv1"},
		{"coded wins over wrapped", withCode(types.ErrInvalidNetworkConfig, fmt.Errorf("x: %w", client.ErrUnreachable)), types.ErrInvalidNetworkConfig, "x:"},
		{"cni error passes", types.NewError(types.ErrIOFailure, "stdin", ""), types.ErrIOFailure, "stdin"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := ToCNIError(tt.err)
			require.Equal(t, tt.wantCode, e.Code)
			require.Contains(t, e.Msg, tt.wantMsg)
		})
	}
	require.Nil(t, ToCNIError(nil))
	require.NoError(t, result(nil), "a nil error stays an untyped nil")
}

func TestRollbackKeepsTheCauseCode(t *testing.T) {
	cause := fmt.Errorf("create endpoint: %w", &api.Error{Code: api.CodeExhausted, Message: "pool p exhausted"})
	cleanup := fmt.Errorf("roll back: %w", client.ErrUnreachable)
	err := withCode(Code(cause), errors.Join(cause, cleanup))
	require.Equal(t, ErrCodePoolExhausted, Code(err))
	require.Contains(t, ToCNIError(err).Msg, "roll back")
}
