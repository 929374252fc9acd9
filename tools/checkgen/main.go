// Command checkgen fails when the committed BPF objects do not match what
// `make generate` just built from the sources. It runs after `go generate`,
// in the repository's root.
//
// Byte equality is too strict: clang 19 orders some BTF types (the forward
// declarations) differently depending on the directory the checkout is in, so
// a clone elsewhere builds the same programs into different bytes. An object
// whose bytes changed therefore passes when its programs, maps, variables and
// types are the same up to the numbering of BTF types; checkgen then restores
// the committed file so the tree stays clean. Generated Go files must match
// byte for byte.
package main

import (
	"bytes"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

func main() {
	changed, err := git("diff", "--name-only", "--", "*_bpfel.go", "*_bpfel.o")
	if err != nil {
		fatal(err)
	}
	var stale []string
	for _, path := range strings.Fields(string(changed)) {
		same, why, err := sameObject(path)
		if err != nil {
			fatal(err)
		}
		if !same {
			fmt.Printf("%s: %s\n", path, why)
			stale = append(stale, path)
			continue
		}
		fmt.Printf("%s: bytes differ only in BTF type order; same programs, maps and types\n", path)
		if _, err := git("checkout", "--", path); err != nil {
			fatal(err)
		}
	}
	if len(stale) > 0 {
		fmt.Println("committed BPF objects are stale: run 'make generate' and commit")
		os.Exit(1)
	}
}

// sameObject compares the generated file at path with its committed version
// (the index's), and says how they differ when they do.
func sameObject(path string) (bool, string, error) {
	if !strings.HasSuffix(path, ".o") {
		return false, "generated Go differs", nil
	}
	committed, err := git("show", ":"+path)
	if err != nil {
		return false, "", err
	}
	generated, err := os.ReadFile(path)
	if err != nil {
		return false, "", err
	}
	want, err := describe(committed)
	if err != nil {
		return false, "", fmt.Errorf("committed %s: %w", path, err)
	}
	got, err := describe(generated)
	if err != nil {
		return false, "", fmt.Errorf("generated %s: %w", path, err)
	}
	for i := range min(len(want), len(got)) {
		if want[i] != got[i] {
			return false, fmt.Sprintf("committed %q, generated %q", want[i], got[i]), nil
		}
	}
	if len(want) != len(got) {
		return false, fmt.Sprintf("%d lines of description committed, %d generated", len(want), len(got)), nil
	}
	return true, "", nil
}

// localID is the part of a CO-RE relocation's text that names a BTF type by
// number, which is what differs between two orders of the same types.
var localID = regexp.MustCompile(`local_id=\d+`)

// describe renders an object as lines that name every BTF type by its content
// rather than its number: programs with their instructions, source lines, BTF
// functions and CO-RE relocations; maps; variables; and the sorted set of
// types.
func describe(object []byte) ([]string, error) {
	spec, err := ebpf.LoadCollectionSpecFromReader(bytes.NewReader(object))
	if err != nil {
		return nil, err
	}
	var lines []string
	add := func(format string, args ...any) { lines = append(lines, fmt.Sprintf(format, args...)) }

	for _, name := range slices.Sorted(maps.Keys(spec.Programs)) {
		p := spec.Programs[name]
		add("program %s: %v %v %q %q %q flags=%d", name, p.Type, p.AttachType, p.AttachTo, p.SectionName, p.License, p.Flags)
		for i, ins := range p.Instructions {
			add("  %d: %v ref=%q sym=%q", i, ins, ins.Reference(), ins.Symbol())
			if src := ins.Source(); src != nil {
				add("     line %s", src)
			}
			if fn := btf.FuncMetadata(&ins); fn != nil {
				add("     func %5v", fn)
			}
			if relo := btf.CORERelocationMetadata(&ins); relo != nil {
				add("     %s", localID.ReplaceAllString(relo.String(), ""))
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(spec.Maps)) {
		m := spec.Maps[name]
		add("map %s: %v key=%d value=%d entries=%d flags=%d pin=%v extra=%d contents=%v",
			name, m.Type, m.KeySize, m.ValueSize, m.MaxEntries, m.Flags, m.Pinning, m.MapExtra, m.Contents)
		add("  key %5v value %5v", m.Key, m.Value)
	}
	for _, name := range slices.Sorted(maps.Keys(spec.Variables)) {
		v := spec.Variables[name]
		add("variable %s: section %q offset %d %5v = %x", name, v.SectionName, v.Offset, v.Type, v.Value)
	}
	var types []string
	for typ, err := range spec.Types.All() {
		if err != nil {
			return nil, err
		}
		types = append(types, fmt.Sprintf("type %5v", typ))
	}
	slices.Sort(types)
	return append(lines, types...), nil
}

func git(args ...string) ([]byte, error) {
	out, err := exec.Command("git", args...).Output()
	if err != nil {
		return nil, fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
	}
	return out, nil
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "checkgen:", err)
	os.Exit(1)
}
