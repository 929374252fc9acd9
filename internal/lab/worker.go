package lab

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The lab's processes (the backend's servers, the Pod's client) are this same
// binary re-executed with a marker in its environment. The environment also
// identifies the lab instance, so a process can be verified as ours before it
// is killed.
const (
	envWorker   = "PATHTRACE_LAB_WORKER" // worker role
	envInstance = "PATHTRACE_LAB_INSTANCE"
	envNetNS    = "PATHTRACE_LAB_NETNS"   // netns the worker joins
	envPIDFile  = "PATHTRACE_LAB_PIDFILE" // server: where it writes its PID once listening
	envClient   = "PATHTRACE_LAB_CLIENT"  // client: its options as JSON

	workerServer = "server"
	workerClient = "client"
)

// RunWorkerIfRequested runs a lab worker and exits when this process was
// started as one; otherwise it returns at once. Call it first in main (and in
// TestMain of tests that use the lab), before anything else happens.
func RunWorkerIfRequested() {
	role := os.Getenv(envWorker)
	if role == "" {
		return
	}
	var err error
	switch role {
	case workerServer:
		err = runServer()
	case workerClient:
		err = runClientWorker()
	default:
		err = fmt.Errorf("unknown worker role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace lab %s: %v\n", role, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// joinNetNS moves the calling goroutine's thread into the netns at path and
// keeps the goroutine on it: sockets it creates belong to that netns (and keep
// working from any thread). The worker exits without leaving the netns.
func joinNetNS(path string) error {
	runtime.LockOSThread()
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns: %w", err)
	}
	defer f.Close()
	if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("join netns %s: %w", path, err)
	}
	return nil
}

func (l *Lab) workerEnv(role, netnsPath string, extra ...string) []string {
	env := append(os.Environ(), envWorker+"="+role, envInstance+"="+l.name, envNetNS+"="+netnsPath)
	return append(env, extra...)
}

// writePIDFile writes the calling process's PID atomically.
func writePIDFile(path string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return fmt.Errorf("write pid file: %w", err)
	}
	return os.Rename(tmp, path)
}

func readPIDFile(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("bad pid file %s", path)
	}
	return pid, nil
}

// isWorkerOf tells whether an environment block (/proc/PID/environ) is that
// of a worker of the lab instance name (of the given role, or any when "").
func isWorkerOf(environ []byte, name, role string) bool {
	var isWorker, isInstance bool
	for _, kv := range bytes.Split(environ, []byte{0}) {
		k, v, _ := strings.Cut(string(kv), "=")
		switch k {
		case envWorker:
			isWorker = v != "" && (role == "" || v == role)
		case envInstance:
			isInstance = v == name
		}
	}
	return isWorker && isInstance
}

// isOurWorker tells whether pid is a live worker of this lab.
func (l *Lab) isOurWorker(pid int, role string) bool {
	env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	return err == nil && isWorkerOf(env, l.name, role) && !isZombie(pid)
}

func isZombie(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true // gone
	}
	// PID (COMM) STATE ...: COMM may contain spaces and parentheses.
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z'
}

// workerPIDs finds this lab's workers: the ones named by PID files, and any
// other process carrying the lab's marker (a worker whose `up` crashed before
// the PID file was written, a client still running).
func (l *Lab) workerPIDs() []int {
	seen := map[int]bool{}
	var pids []int
	add := func(pid int) {
		if !seen[pid] && l.isOurWorker(pid, "") {
			seen[pid] = true
			pids = append(pids, pid)
		}
	}
	if pid, err := readPIDFile(l.serverPIDFile()); err == nil {
		add(pid)
	}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && pid != os.Getpid() {
			add(pid)
		}
	}
	return pids
}

// killWorkers stops every worker of this lab: SIGTERM, then SIGKILL.
func (l *Lab) killWorkers() error {
	pids := l.workerPIDs()
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGTERM)
	}
	deadline := time.Now().Add(3 * time.Second)
	for _, pid := range pids {
		for l.isOurWorker(pid, "") {
			if time.Now().After(deadline) {
				syscall.Kill(pid, syscall.SIGKILL)
			}
			if time.Now().After(deadline.Add(2 * time.Second)) {
				return fmt.Errorf("lab worker %d does not exit", pid)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

func (l *Lab) serverPIDFile() string { return filepath.Join(l.stateDir(), "server.pid") }
func (l *Lab) serverLog() string     { return filepath.Join(l.stateDir(), "server.log") }

// lastLines is the end of a log file, for error messages.
func lastLines(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "; ")
}
