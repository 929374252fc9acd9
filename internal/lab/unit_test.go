package lab

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	// The lab's servers and client are this test binary, re-executed.
	RunWorkerIfRequested()
	os.Exit(m.Run())
}

// The chain names must be what kube-proxy makes; the expected values are the
// examples in kube-proxy's nftables proxier.
func TestKubeProxyChainNames(t *testing.T) {
	if got := hashAndTruncate("ns1/svc1/tcp/p80"); got != "ULMVA6XW-ns1/svc1/tcp/p80" {
		t.Errorf("service base = %q", got)
	}
	if got := hashAndTruncate("ns1/svc1/tcp/p80__10.180.0.1/80"); got != "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80" {
		t.Errorf("endpoint base = %q", got)
	}
	web := labServices()[0]
	if got, want := web.serviceChain(), "service-"+hashAndTruncate("default/web/tcp/http"); got != want {
		t.Errorf("service chain = %q, want %q", got, want)
	}
	if got := web.endpointChain(); !strings.HasSuffix(got, "-default/web/tcp/http__10.244.20.31/3000") ||
		!strings.HasPrefix(got, "endpoint-") {
		t.Errorf("endpoint chain = %q", got)
	}
}

func TestIsWorkerOf(t *testing.T) {
	env := func(kv ...string) []byte { return []byte(strings.Join(kv, "\x00") + "\x00") }
	for _, tc := range []struct {
		name      string
		environ   []byte
		lab, role string
		want      bool
	}{
		{"server of lab", env("PATH=/bin", envWorker+"=server", envInstance+"=ptlab"), "ptlab", "server", true},
		{"any role", env(envWorker+"=client", envInstance+"=ptlab"), "ptlab", "", true},
		{"other role", env(envWorker+"=client", envInstance+"=ptlab"), "ptlab", "server", false},
		{"other lab", env(envWorker+"=server", envInstance+"=ptlab2"), "ptlab", "", false},
		{"prefix of lab name", env(envWorker+"=server", envInstance+"=ptla"), "ptlab", "", false},
		{"no marker", env(envInstance + "=ptlab"), "ptlab", "", false},
		{"empty", nil, "ptlab", "", false},
	} {
		if got := isWorkerOf(tc.environ, tc.lab, tc.role); got != tc.want {
			t.Errorf("%s: isWorkerOf = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestLabProgramName(t *testing.T) {
	for kernel, want := range map[string]string{
		"lab_vlan_push":   "lab_vlan_push",
		"lab_sock4_conne": "lab_sock4_connect",
		"lab_from_contai": "lab_from_container",
		"lab_sock4":       "", // a prefix that is not a cut name
		"cil_sock4_conne": "",
		"":                "",
	} {
		if got := labProgramName(kernel); got != want {
			t.Errorf("labProgramName(%q) = %q, want %q", kernel, got, want)
		}
	}
	for _, name := range labProgramNames() {
		if got := labProgramName(name[:min(len(name), kernelNameMax)]); got != name {
			t.Errorf("%s cut by the kernel maps to %q", name, got)
		}
	}
}

func TestNetworkOrder(t *testing.T) {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], be32(TCPVIP.Addr()))
	if b != [4]byte{10, 120, 0, 80} {
		t.Errorf("be32 memory = %v", b)
	}
	var p [2]byte
	binary.NativeEndian.PutUint16(p[:], be16(3000))
	if p != [2]byte{0x0b, 0xb8} {
		t.Errorf("be16 memory = %v", p)
	}
}

func TestParseModeAndNames(t *testing.T) {
	for _, m := range Modes() {
		if got, err := ParseMode(string(m)); err != nil || got != m {
			t.Errorf("ParseMode(%q) = %q, %v", m, got, err)
		}
	}
	if _, err := ParseMode("ipvs"); err == nil {
		t.Error("ParseMode accepts ipvs")
	}
	for name, ok := range map[string]bool{"ptlab": true, "pttest-lab-0a1b2c": true, "": false,
		"Lab": false, "a/b": false, "-x": false, strings.Repeat("a", 33): false} {
		if err := CheckName(name); (err == nil) != ok {
			t.Errorf("CheckName(%q) = %v", name, err)
		}
	}
	if New("").Name() != DefaultName {
		t.Error("New(\"\") is not the default lab")
	}
}

// TestNotUpSaysWhatToRun: a lab that is not up has its client and its
// health check name the command that builds it, with its --name (without
// it, following the advice built the default lab).
func TestNotUpSaysWhatToRun(t *testing.T) {
	l := New("rdnotup")
	if isNetNS(l.PodNetNS()) {
		t.Skipf("a lab %s exists", l.Name())
	}
	const want = "`pathtrace lab up --name rdnotup`"
	_, err := l.Client(context.Background(), ClientOptions{Requests: 1})
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("client of a lab that is not up: %v; want it to say %s", err, want)
	}
	if _, health := l.health(Status{}); !strings.Contains(health, want) {
		t.Errorf("health of a lab that is not up: %q; want it to say %s", health, want)
	}
	if got := New("").Command("up"); got != "pathtrace lab up" {
		t.Errorf("the default lab's up command: %q", got)
	}
}

func TestClassify(t *testing.T) {
	op := func(err error) error {
		return &net.OpError{Op: "dial", Net: "tcp4", Err: os.NewSyscallError("connect", err)}
	}
	for _, tc := range []struct {
		err  error
		want FailureKind
	}{
		{op(unix.ENETUNREACH), FailUnreachable},
		{op(unix.EHOSTUNREACH), FailUnreachable},
		{op(unix.ECONNREFUSED), FailRefused},
		{&net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, FailTimeout},
		{errors.New("boom"), FailOther},
	} {
		if got := classify(tc.err); got != tc.want {
			t.Errorf("classify(%v) = %s, want %s", tc.err, got, tc.want)
		}
	}
}

func TestProtoResultCounts(t *testing.T) {
	var p ProtoResult
	p.add(RequestResult{OK: true})
	p.add(RequestResult{Kind: FailTimeout})
	p.add(RequestResult{OK: true})
	if p.OK != 2 || p.Failed != 1 || len(p.Requests) != 3 {
		t.Fatalf("counts = %+v", p)
	}
	if o := (ClientOptions{}).withDefaults(); o.Requests != 1 || o.Timeout != time.Second {
		t.Fatalf("defaults = %+v", o)
	}
}

func TestIsZombieOfMissingProcess(t *testing.T) {
	if !isZombie(1 << 30) {
		t.Fatal("a missing process counts as alive")
	}
	if isZombie(os.Getpid()) {
		t.Fatalf("this process (%d) counts as gone", os.Getpid())
	}
}
