package bpf

// The generated kvipam_bpfel.go and kvipam_bpfel.o are committed, so building
// the agent needs no C toolchain. Run ./generate.sh after changing kvipam.c.
//
// -I/usr/include/x86_64-linux-gnu: Debian keeps asm/types.h there.
//go:generate go tool bpf2go -tags linux -target bpfel -type addr_key -type addr_info -type iface_info -type counters -type hostport_key -type hostport_info -type nat_key -type nat_info kvipam kvipam.c -- -I/usr/include/x86_64-linux-gnu -Wall -Werror
