package announce

import (
	"fmt"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// snapLen is how much of a frame the filter keeps: an NA with its target
// link-layer option is 86 bytes.
const snapLen = 128

// socketFilter is the classic BPF program of the packet watcher's socket:
// it keeps incoming ARP and RARP frames and IPv6 frames whose next header
// is ICMPv6 with type 136 (a neighbor advertisement), and nothing the host
// sends out of the veth. The rest never wakes the agent.
func socketFilter() ([]unix.SockFilter, error) {
	const (
		drop = 0
		keep = snapLen
	)
	prog := []bpf.Instruction{
		// 0: the frame's direction; outgoing frames are the host's own.
		bpf.LoadExtension{Num: bpf.ExtType},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: unix.PACKET_OUTGOING, SkipTrue: 9},
		// 2: the ethertype.
		bpf.LoadAbsolute{Off: 12, Size: 2},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeARP, SkipTrue: 6},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeRARP, SkipTrue: 5},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeIPv6, SkipFalse: 5},
		// 6: IPv6 next header, then the ICMPv6 type.
		bpf.LoadAbsolute{Off: ethHeader + 6, Size: 1},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: protoICMPv6, SkipFalse: 3},
		bpf.LoadAbsolute{Off: ethHeader + ipv6Len, Size: 1},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: icmpv6NA, SkipFalse: 1},
		// 10
		bpf.RetConstant{Val: keep},
		// 11
		bpf.RetConstant{Val: drop},
	}
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil, fmt.Errorf("assemble socket filter: %w", err)
	}
	out := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		out[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	return out, nil
}
