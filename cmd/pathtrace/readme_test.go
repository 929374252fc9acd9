package main

import (
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/report"
)

// TestJSONFieldsDocumented: every key of the node, flow and summary JSON
// lines is named in README's part on them (a user's jq filter starts
// there): the node's and the summary's in their paragraph (a run until
// stopped's in its section), the flow's in the first column of its table.
func TestJSONFieldsDocumented(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	part := func(from, to string) string {
		i := strings.Index(readme, from)
		j := strings.Index(readme[i+1:], to)
		if i < 0 || j < 0 {
			t.Fatalf("README has no part from %q to %q", from, to)
		}
		return readme[i : i+1+j]
	}
	node := part("1. `{\"type\":\"node\"", "2. one `{\"type\":\"flow\"")
	var flowColumn strings.Builder
	for _, line := range strings.Split(part("2. one `{\"type\":\"flow\"", "3. `{\"type\":\"summary\""), "\n") {
		if cells := strings.Split(line, "|"); len(cells) > 2 {
			flowColumn.WriteString(cells[1])
		}
	}
	// A run until stopped adds to the summary: its section says what.
	summary := part("3. `{\"type\":\"summary\"", "### The capture file")
	for _, c := range []struct {
		what string
		text string
		keys []string
	}{
		{"node", node, append(jsonKeys(discover.NodeInfo{}), "observers")},
		{"flow", flowColumn.String(), jsonKeys(flow.Flow{})},
		{"summary", summary, append(jsonKeys(flow.Summary{}), jsonKeys(report.Run{})...)},
	} {
		for _, k := range c.keys {
			if !strings.Contains(c.text, "`"+k+"`") && !strings.Contains(c.text, `"`+k+`":`) {
				t.Errorf("the %s line's %q is not in README's part on it", c.what, k)
			}
		}
	}
}

// jsonKeys are the JSON keys of a struct's exported fields, those of
// embedded structs included.
func jsonKeys(v any) []string {
	var keys []string
	t := reflect.TypeOf(v)
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Anonymous {
			keys = append(keys, jsonKeys(reflect.Zero(f.Type).Interface())...)
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" && f.IsExported() {
			keys = append(keys, name)
		}
	}
	return keys
}
