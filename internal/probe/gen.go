package probe

// The BPF objects are generated from bpf/observe_*.c and committed, so a plain
// `go build` needs no clang. Regenerate with `make generate`.
//go:generate go tool bpf2go -tags linux -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -D__TARGET_ARCH_x86" observeSock ../../bpf/observe_sock.c
//go:generate go tool bpf2go -tags linux -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -D__TARGET_ARCH_x86" observeTC ../../bpf/observe_tc.c
//go:generate go tool bpf2go -tags linux -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -D__TARGET_ARCH_x86" observeNF ../../bpf/observe_nf.c
//go:generate go tool bpf2go -tags linux -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -D__TARGET_ARCH_x86" observePkt ../../bpf/observe_pkt.c
//go:generate go tool bpf2go -tags linux -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -D__TARGET_ARCH_x86" observeDrop ../../bpf/observe_drop.c
