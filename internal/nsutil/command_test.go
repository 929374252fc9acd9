package nsutil

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// commandParentEnv makes the test binary play the parent that starts a
// program with Command and is then killed.
const commandParentEnv = "NSUTIL_TEST_COMMAND_PARENT"

func TestMain(m *testing.M) {
	if os.Getenv(commandParentEnv) != "" {
		cmd := Command(context.Background(), "sleep", "60")
		if err := cmd.Start(); err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		fmt.Println(cmd.Process.Pid)
		cmd.Wait() // until the test kills this process
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// A program started with Command dies with pathtrace, even when pathtrace is
// killed by SIGKILL: it is not left running to its end, reparented to init.
func TestCommandDiesWithItsParent(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	parent := exec.Command(os.Args[0], "-test.run=^$")
	parent.Env = append(os.Environ(), commandParentEnv+"=1")
	out, err := parent.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { parent.Process.Kill(); parent.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("parent said nothing: %v", err)
	}
	child, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("parent: %q", line)
	}
	t.Cleanup(func() { syscall.Kill(child, syscall.SIGKILL) })

	parent.Process.Kill()
	parent.Wait()
	for deadline := time.Now().Add(3 * time.Second); alive(child); {
		if time.Now().After(deadline) {
			t.Fatalf("the program (pid %d) outlived its killed parent", child)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// alive tells whether pid runs (a zombie, dead and not reaped yet, does not).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || !strings.HasPrefix(s[i+1:], " Z")
}
