//go:build linux

package bpf

import (
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"
)

// BenchmarkAttachDetach measures what one endpoint costs the agent: Attach
// (map writes, TCX link, pin) plus Detach (unpin, detach, map removal) on a
// host veth, for TCX, for the clsact fallback, and for re-attaching an
// endpoint that is already attached (the agent's restart and retry path).
func BenchmarkAttachDetach(b *testing.B) {
	requireDatapath(b)
	h := newHost(b)
	p := h.addPod(b, 1)
	d := openDatapath(b, pinDir(b))

	run := func(b *testing.B, mode string) {
		d.mode = mode
		err := h.ns.Do(func(ns.NetNS) error {
			for b.Loop() {
				if err := d.Attach(p.ep); err != nil {
					return err
				}
				if err := d.Detach(p.ep); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	b.Run("tcx", func(b *testing.B) { run(b, AttachTCX) })
	b.Run("clsact", func(b *testing.B) { run(b, AttachTC) })
	b.Run("reattach", func(b *testing.B) {
		d.mode = AttachTCX
		h.attach(b, d, p.ep)
		err := h.ns.Do(func(ns.NetNS) error {
			for b.Loop() {
				if err := d.Attach(p.ep); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
		h.detach(b, d, p.ep)
	})
}
