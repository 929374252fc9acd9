package main

import (
	"bytes"
	"os"
	"slices"
	"testing"
)

// The three objects are bpf/lab_vlan.c built by `make generate`: in this
// repository's usual checkout, in a checkout at a longer path (clang put two
// forward declarations in the other order), and with vlan_id's default
// changed from 0 to 7.
func TestDescribeIgnoresOnlyTheOrderOfTypes(t *testing.T) {
	committed := readObject(t, "testdata/labvlan.o")
	otherCheckout := readObject(t, "testdata/labvlan-other-checkout.o")
	changed := readObject(t, "testdata/labvlan-vid7.o")
	if bytes.Equal(committed, otherCheckout) {
		t.Fatal("testdata: the two checkouts' objects are byte-equal, so the test would prove nothing")
	}

	want := describeObject(t, committed)
	if got := describeObject(t, otherCheckout); !slices.Equal(got, want) {
		t.Errorf("the same source built in another checkout is described differently:\n%q\n%q", got, want)
	}
	if got := describeObject(t, changed); slices.Equal(got, want) {
		t.Error("an object whose .rodata changed is described as the committed one")
	}
}

func readObject(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func describeObject(t *testing.T, object []byte) []string {
	t.Helper()
	lines, err := describe(object)
	if err != nil {
		t.Fatal(err)
	}
	return lines
}
