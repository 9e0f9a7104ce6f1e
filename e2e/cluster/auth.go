package cluster

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// RootUser is etcd's administrator. The harness itself connects as this
// user (by certificate), so its status requests and the helpers below keep
// working once EnableAuth has turned authentication on.
const RootUser = "root"

// Role is an etcd RBAC role that may read, and unless ReadOnly also write,
// every key that starts with Prefix.
type Role struct {
	Name     string
	Prefix   string
	ReadOnly bool
}

// EnableAuth creates the root user (no password: it authenticates with its
// certificate, ClientConfig(RootUser)), gives it the root role and turns
// authentication on. From then on every request needs a user: a client
// certificate's CN, or a name and password.
func (c *Cluster) EnableAuth(ctx context.Context) error {
	admin, err := c.adminClient()
	if err != nil {
		return err
	}
	_, err = admin.UserAddWithOptions(ctx, RootUser, "", &clientv3.UserAddOptions{NoPassword: true})
	if err != nil && !errors.Is(err, rpctypes.ErrUserAlreadyExist) {
		return fmt.Errorf("add root user: %w", err)
	}
	if _, err := admin.UserGrantRole(ctx, RootUser, "root"); err != nil {
		return fmt.Errorf("grant root role: %w", err)
	}
	if _, err := admin.AuthEnable(ctx); err != nil {
		return fmt.Errorf("enable auth: %w", err)
	}
	return nil
}

// AddRole creates role r, if it does not exist, and grants it its
// permission on its prefix.
func (c *Cluster) AddRole(ctx context.Context, r Role) error {
	admin, err := c.adminClient()
	if err != nil {
		return err
	}
	if _, err := admin.RoleAdd(ctx, r.Name); err != nil && !errors.Is(err, rpctypes.ErrRoleAlreadyExist) {
		return fmt.Errorf("add role %s: %w", r.Name, err)
	}
	perm := clientv3.PermReadWrite
	if r.ReadOnly {
		perm = clientv3.PermRead
	}
	_, err = admin.RoleGrantPermission(ctx, r.Name, r.Prefix, clientv3.GetPrefixRangeEnd(r.Prefix), clientv3.PermissionType(perm))
	if err != nil {
		return fmt.Errorf("grant role %s on %q: %w", r.Name, r.Prefix, err)
	}
	return nil
}

// AddUser creates user name with roles, adding each role as AddRole does.
// With an empty password the user can only authenticate by certificate
// (ClientConfig(name)); with one, also by name and password.
func (c *Cluster) AddUser(ctx context.Context, name, password string, roles ...Role) error {
	admin, err := c.adminClient()
	if err != nil {
		return err
	}
	if _, err := admin.UserAddWithOptions(ctx, name, password, &clientv3.UserAddOptions{NoPassword: password == ""}); err != nil {
		return fmt.Errorf("add user %s: %w", name, err)
	}
	for _, r := range roles {
		if err := c.AddRole(ctx, r); err != nil {
			return err
		}
		if _, err := admin.UserGrantRole(ctx, name, r.Name); err != nil {
			return fmt.Errorf("grant role %s to %s: %w", r.Name, name, err)
		}
	}
	return nil
}

// adminClient is the cluster's client as RootUser, made on first use and
// closed by the cluster's cleanup.
func (c *Cluster) adminClient() (*clientv3.Client, error) {
	c.adminMu.Lock()
	defer c.adminMu.Unlock()
	if c.admin != nil {
		return c.admin, nil
	}
	cfg, err := c.ClientV3Config(RootUser)
	if err != nil {
		return nil, err
	}
	if c.admin, err = clientv3.New(cfg); err != nil {
		return nil, fmt.Errorf("connect as %s: %w", RootUser, err)
	}
	return c.admin, nil
}
