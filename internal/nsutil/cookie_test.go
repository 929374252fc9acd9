package nsutil

import (
	"os"
	"os/exec"
	"testing"
)

// A netns's cookie is the same read twice and differs from another netns's
// (whose inode may be a deleted one's again).
func TestCookie(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: Cookie joins the netns (setns)")
	}
	self, err := Cookie(Self)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := Cookie(Self); err != nil || self == 0 || again != self {
		t.Fatalf("cookie of this netns %d, then %d (%v): want one non-zero cookie", self, again, err)
	}
	const name = "ptnsutil-cookie"
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Skipf("ip netns add: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	other, err := Cookie("/run/netns/" + name)
	if err != nil || other == 0 || other == self {
		t.Errorf("cookie of another netns %d (%v), of this one %d: want another non-zero cookie", other, err, self)
	}
	if _, err := Cookie("/nonexistent/ns"); err == nil {
		t.Error("Cookie of a missing path: no error")
	}
}
