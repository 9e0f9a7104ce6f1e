package k8s

import (
	"encoding/json"
	"fmt"
	"time"
)

// --- the API: objects as JSON ---

type objMeta struct {
	Name              string            `json:"name"`
	Namespace         string            `json:"namespace"`
	UID               string            `json:"uid"`
	Annotations       map[string]string `json:"annotations"`
	CreationTimestamp time.Time         `json:"creationTimestamp"`
	DeletionTimestamp *time.Time        `json:"deletionTimestamp"`
}

type condition struct {
	Type               string    `json:"type"`
	Status             string    `json:"status"`
	Reason             string    `json:"reason"`
	Message            string    `json:"message"`
	LastTransitionTime time.Time `json:"lastTransitionTime"`
}

type pod struct {
	Metadata objMeta `json:"metadata"`
	Spec     struct {
		NodeName string `json:"nodeName"`
	} `json:"spec"`
	Status struct {
		Phase        string                `json:"phase"`
		PodIPs       []struct{ IP string } `json:"podIPs"`
		Conditions   []condition           `json:"conditions"`
		InitStatuses []struct {
			Name  string `json:"name"`
			Ready bool   `json:"ready"`
			State struct {
				Terminated *struct {
					ExitCode int    `json:"exitCode"`
					Reason   string `json:"reason"`
				} `json:"terminated"`
			} `json:"state"`
		} `json:"initContainerStatuses"`
		ContainerStatuses []struct {
			Name         string `json:"name"`
			Ready        bool   `json:"ready"`
			RestartCount int    `json:"restartCount"`
		} `json:"containerStatuses"`
	} `json:"status"`
}

func (p pod) ready() bool {
	for _, c := range p.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

func (p pod) ips() []string {
	var ips []string
	for _, ip := range p.Status.PodIPs {
		ips = append(ips, ip.IP)
	}
	return ips
}

func (c *kcluster) getPods(args ...string) ([]pod, error) {
	out, err := c.kubectl(append([]string{"get", "pods", "-o", "json"}, args...)...)
	if err != nil {
		return nil, err
	}
	var l struct{ Items []pod }
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return nil, fmt.Errorf("decode pods: %w", err)
	}
	return l.Items, nil
}

func (c *kcluster) getPod(ns, name string) (pod, error) {
	out, err := c.kubectl("-n", ns, "get", "pod", name, "-o", "json")
	if err != nil {
		return pod{}, err
	}
	var p pod
	if err := json.Unmarshal([]byte(out), &p); err != nil {
		return pod{}, fmt.Errorf("decode pod: %w", err)
	}
	return p, nil
}

// ipRecord is one allocation as kvipamctl ip list -o json prints it.
type ipRecord struct {
	Pool      string `json:"pool"`
	IP        string `json:"ip"`
	Node      string `json:"node"`
	State     string `json:"state"`
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	PodUID    string `json:"podUID"`
	Identity  string `json:"identity"`
	// ContainerID and IfName are the owner's attachment.
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName"`
	// Imported is the import source the address was taken from.
	Imported string `json:"imported"`
	// Network is the CNI network of the attachment.
	Network string `json:"network"`
}

func (c *kcluster) ipRecords() ([]ipRecord, error) {
	out, err := c.kvipamctl("-o", "json", "ip", "list")
	if err != nil {
		return nil, err
	}
	var recs []ipRecord
	if err := json.Unmarshal([]byte(out), &recs); err != nil {
		return nil, fmt.Errorf("decode kvipamctl ip list: %w: %s", err, tail(out, 500))
	}
	return recs, nil
}
