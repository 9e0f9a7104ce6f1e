//go:build !linux

package cluster

import (
	"errors"
	"syscall"
	"time"
)

// sysProcAttr is nil off Linux: there is no Pdeathsig, and a killed test
// binary leaves its members running.
func sysProcAttr() *syscall.SysProcAttr { return nil }

// waitStopped does not wait off Linux: there is no /proc to ask.
func waitStopped(pid int, stopped bool, done <-chan struct{}) error { return nil }

// processCPU is not known off Linux.
func processCPU(pid int) (time.Duration, error) {
	return 0, errors.New("cluster: process CPU time needs Linux's /proc")
}

// processRSS is not known off Linux.
func processRSS(pid int) (int64, error) {
	return 0, errors.New("cluster: process memory needs Linux's /proc")
}
