package probe

import (
	"errors"
	"fmt"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// kprobePMU exists when the kernel can create kprobe perf events.
const kprobePMU = "/sys/bus/event_source/devices/kprobe"

// fentryTarget is a vmlinux function used to test whether trampolines load.
const fentryTarget = "tcp_connect"

// KernelFunctionProbes reports whether kernel-function probes (kprobe,
// kprobe-multi, fentry) are usable here. They would only refine attribution
// (e.g. nf_nat_manip_pkt); a verdict never needs them, so an unavailable one is
// reported with its reason and nothing else happens. Nothing is attached.
func KernelFunctionProbes() []Attachment {
	return []Attachment{detectKprobe(), detectKprobeMulti(), detectFentry()}
}

func detectKprobe() Attachment {
	a := Attachment{Observer: "kprobe", Where: "kernel functions", Point: obs.PointNone}
	if _, err := os.Stat(kprobePMU); err != nil {
		a.Err = fmt.Errorf("unavailable: %s absent (kernel without CONFIG_KPROBES)", kprobePMU)
		return a
	}
	a.Note = "available, not used for verdicts"
	return a
}

func detectKprobeMulti() Attachment {
	a := Attachment{Observer: "kprobe-multi", Where: "kernel functions", Point: obs.PointNone}
	err := features.HaveBPFLinkKprobeMulti()
	switch {
	case errors.Is(err, ebpf.ErrNotSupported):
		// The library's message names a kernel version; here the kernel is
		// recent enough and refuses the link (EINVAL/EOPNOTSUPP, e.g. no fprobe).
		a.Err = errors.New("unavailable: the kernel refuses kprobe-multi links (needs CONFIG_FPROBE)")
		return a
	case err != nil:
		a.Err = fmt.Errorf("unavailable: %w", err)
		return a
	}
	a.Note = "available, not used for verdicts"
	return a
}

// detectFentry loads (never attaches) an empty fentry program.
func detectFentry() Attachment {
	a := Attachment{Observer: "fentry", Where: "kernel functions", Point: obs.PointNone}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "pt_fentry_test",
		Type:         ebpf.Tracing,
		AttachType:   ebpf.AttachTraceFEntry,
		AttachTo:     fentryTarget,
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
		License:      "GPL",
	})
	switch {
	case errors.Is(err, unix.EPERM):
		a.Err = fmt.Errorf("unavailable: loading an fentry program fails with EPERM (this kernel refuses BPF trampolines)")
	case err != nil:
		a.Err = fmt.Errorf("unavailable: load fentry program on %s: %w", fentryTarget, err)
	default:
		prog.Close()
		a.Note = "available, not used for verdicts"
	}
	return a
}
