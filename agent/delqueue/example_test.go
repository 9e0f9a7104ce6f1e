package delqueue_test

import (
	"context"
	"fmt"
	"os"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
)

// A plugin whose agent is down queues the DEL; the agent drains the queue
// when it starts.
func Example() {
	dir, _ := os.MkdirTemp("", "del-queue")
	defer os.RemoveAll(dir)

	// In the plugin, when the release cannot reach the agent:
	_ = delqueue.Enqueue(dir, api.Owner{ContainerID: "c1", IfName: "eth0"})
	_ = delqueue.Enqueue(dir, api.Owner{ContainerID: "c1", IfName: "eth0"}) // a retried DEL

	// In the agent, at start:
	n, err := delqueue.Drain(context.Background(), dir, func(_ context.Context, o api.Owner) error {
		fmt.Println("release", o.ContainerID, o.IfName)
		return nil
	})
	fmt.Println(n, err)
	// Output:
	// release c1 eth0
	// 1 <nil>
}
