package lab

// The lab's BPF programs: the VLAN-tagging uplink and the Service load balancers.
//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror -D__TARGET_ARCH_x86" labVLAN ../../bpf/lab_vlan.c
//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror -D__TARGET_ARCH_x86" labLB ../../bpf/lab_lb.c
