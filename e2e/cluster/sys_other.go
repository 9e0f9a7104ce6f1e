//go:build !linux

package cluster

import "syscall"

// sysProcAttr is nil off Linux: there is no Pdeathsig, and a killed test
// binary leaves its members running.
func sysProcAttr() *syscall.SysProcAttr { return nil }

// waitStopped does not wait off Linux: there is no /proc to ask.
func waitStopped(pid int, stopped bool, done <-chan struct{}) error { return nil }
