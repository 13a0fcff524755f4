package doctor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/rblk/rblk/target"
)

// files is a fixture tree: path (relative to a root) to content; a
// content starting with "->" makes a symbolic link to the rest, a path
// ending in "/" an empty folder.
type files map[string]string

// write creates the tree under root.
func (fs files) write(t *testing.T, root string) {
	t.Helper()
	for p, content := range fs {
		if strings.HasSuffix(p, "/") {
			if err := os.MkdirAll(filepath.Join(root, p), 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		p = filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		if target, ok := strings.CutPrefix(content, "->"); ok {
			err = os.Symlink(target, p)
		} else {
			err = os.WriteFile(p, []byte(content), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// merge returns fs with more added (or replaced; "" removes a path).
func (fs files) merge(more files) files {
	out := files{}
	for k, v := range fs {
		out[k] = v
	}
	for k, v := range more {
		if v == "" {
			delete(out, k)
			continue
		}
		out[k] = v
	}
	return out
}

// newEnv writes the tree into a fresh root with sys/, proc/, dev/,
// modules/ and lib/ in it, and returns an Env reading it.
func newEnv(t *testing.T, tree files) Env {
	t.Helper()
	root := t.TempDir()
	tree.write(t, root)
	for _, d := range []string{"sys", "proc", "dev", "modules", "lib"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return Env{SysRoot: filepath.Join(root, "sys"), ProcRoot: filepath.Join(root, "proc"), DevRoot: filepath.Join(root, "dev"),
		ModulesRoot: filepath.Join(root, "modules"), LibDirs: []string{filepath.Join(root, "lib"), filepath.Join(root, "lib")}, UID: os.Geteuid(), RDMASupported: true,
		Clock: func() (bool, string, error) { return true, "synchronized (fixture)", nil }}
}

// find returns the check called name (or whose name starts with it).
func find(t *testing.T, checks []Check, name string) Check {
	t.Helper()
	for _, c := range checks {
		if c.Name == name || strings.HasPrefix(c.Name, name+" ") {
			return c
		}
	}
	t.Fatalf("no check %q in %+v", name, checks)
	return Check{}
}

func has(checks []Check, name string) bool {
	for _, c := range checks {
		if c.Name == name || strings.HasPrefix(c.Name, name+" ") {
			return true
		}
	}
	return false
}

// want asserts a check's outcome: ok, and (for a failure) that its detail
// and fix contain the strings given.
func want(t *testing.T, c Check, ok bool, detail, fix string) {
	t.Helper()
	if c.OK != ok {
		t.Errorf("%s: ok %v, want %v (detail %q, fix %q)", c.Name, c.OK, ok, c.Detail, c.Fix)
	}
	if !strings.Contains(c.Detail, detail) {
		t.Errorf("%s: detail %q does not say %q", c.Name, c.Detail, detail)
	}
	if ok && c.Fix != "" {
		t.Errorf("%s passed but has a fix: %q", c.Name, c.Fix)
	}
	if !ok && (c.Fix == "" || !strings.Contains(c.Fix, fix)) {
		t.Errorf("%s: fix %q does not say %q", c.Name, c.Fix, fix)
	}
}

// rxe is a healthy Soft-RoCE device on dummy0 (192.0.2.1), its device
// nodes, the libraries, and a process without CAP_IPC_LOCK and an
// unlimited memlock limit.
var rxe = files{
	"sys/class/infiniband/rxe0/ports/1/state":             "4: ACTIVE\n",
	"sys/class/infiniband/rxe0/ports/1/phys_state":        "5: LinkUp\n",
	"sys/class/infiniband/rxe0/ports/1/link_layer":        "Ethernet\n",
	"sys/class/infiniband/rxe0/ports/1/gids/0":            "fe80:0000:0000:0000:b0c4:1dff:fe5a:a5c6\n",
	"sys/class/infiniband/rxe0/ports/1/gids/1":            "0000:0000:0000:0000:0000:ffff:c000:0201\n",
	"sys/class/infiniband/rxe0/ports/1/gids/2":            "0000:0000:0000:0000:0000:0000:0000:0000\n",
	"sys/class/infiniband/rxe0/ports/1/gid_attrs/types/0": "IB/RoCE v1\n",
	"sys/class/infiniband/rxe0/ports/1/gid_attrs/types/1": "RoCE v2\n",
	"sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/0": "dummy0\n",
	"sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/1": "dummy0\n",
	"sys/class/net/dummy0/mtu":                            "1500\n",
	"dev/infiniband/uverbs0":                              "x",
	"dev/infiniband/rdma_cm":                              "x",
	"proc/self/status":                                    "Name:\trblkd\nCapEff:\t0000000000000000\n",
	"proc/self/limits":                                    "Limit                     Soft Limit           Hard Limit           Units     \nMax locked memory         unlimited            unlimited            bytes     \n",
	"lib/libibverbs.so.1":                                 "x",
	"lib/librdmacm.so.1":                                  "x",
	"lib/libibverbs/librxe-rdmav34.so":                    "x",
}

func TestRDMAChecks(t *testing.T) {
	const limited = "Limit                     Soft Limit           Hard Limit           Units     \nMax locked memory         8388608              8388608              bytes     \n"
	cases := []struct {
		name      string
		tree      files
		supported bool
		check     string
		ok        bool
		detail    string
		fix       string
	}{
		{"healthy: devices", rxe, true, "rdma devices", true, "rxe0", ""},
		{"healthy: port", rxe, true, "rdma port rxe0/1", true, "netdev dummy0", ""},
		{"healthy: gids", rxe, true, "rdma gids rxe0/1", true, "RoCE v2: 192.0.2.1 (index 1)", ""},
		{"healthy: mtu", rxe, true, "rdma mtu rxe0/1", true, "dummy0 mtu 1500: RoCE MTU 1024", ""},
		{"jumbo mtu", rxe.merge(files{"sys/class/net/dummy0/mtu": "9000"}), true, "rdma mtu rxe0/1", true, "RoCE MTU 4096", ""},
		{"healthy: nodes", rxe, true, "rdma device nodes", true, "uverbs0, rdma_cm", ""},
		{"healthy: libraries", rxe, true, "rdma-core libraries", true, "1 provider drivers", ""},
		{"healthy: memlock", rxe, true, "memlock limit", true, "unlimited", ""},
		{"no class folder", files{}, true, "rdma devices", false, "does not exist", "rdma link add rxe0 type rxe netdev"},
		{"empty class folder", files{"sys/class/infiniband/": "dir"}, true, "rdma devices", false, "", "modprobe rdma_rxe"},
		{"port down", rxe.merge(files{"sys/class/infiniband/rxe0/ports/1/state": "1: DOWN", "sys/class/infiniband/rxe0/ports/1/phys_state": "3: Disabled"}),
			true, "rdma port rxe0/1", false, "state 1: DOWN", "ip link set dummy0 up"},
		{"infiniband without subnet manager", files{
			"sys/class/infiniband/mlx5_0/ports/1/state": "2: INIT", "sys/class/infiniband/mlx5_0/ports/1/phys_state": "5: LinkUp",
			"sys/class/infiniband/mlx5_0/ports/1/link_layer": "InfiniBand"}, true, "rdma port mlx5_0/1", false, "2: INIT", "opensm"},
		{"no RoCE v2 gid", rxe.merge(files{"sys/class/infiniband/rxe0/ports/1/gid_attrs/types/1": "IB/RoCE v1"}),
			true, "rdma gids rxe0/1", false, "no RoCE v2 GID", "ip addr add ADDR/PREFIX dev dummy0"},
		{"small mtu", rxe.merge(files{"sys/class/net/dummy0/mtu": "1000"}), true, "rdma mtu rxe0/1", false, "RoCE MTU 512", "ip link set dummy0 mtu"},
		{"no uverbs", rxe.merge(files{"dev/infiniband/uverbs0": ""}), true, "rdma device nodes", false, "missing", "modprobe ib_uverbs rdma_ucm"},
		{"no rdma_cm", rxe.merge(files{"dev/infiniband/rdma_cm": ""}), true, "rdma device nodes", false, "rdma_cm", "modprobe ib_uverbs rdma_ucm"},
		{"memlock too low", rxe.merge(files{"proc/self/limits": limited}), true, "memlock limit", false, "8 MiB; needs about", "LimitMEMLOCK=infinity"},
		{"memlock low but CAP_IPC_LOCK", rxe.merge(files{"proc/self/limits": limited, "proc/self/status": "CapEff:\t000001ffffffffff\n"}),
			true, "memlock limit", true, "CAP_IPC_LOCK", ""},
		{"no libibverbs", rxe.merge(files{"lib/libibverbs.so.1": ""}), true, "rdma-core libraries", false, "missing libibverbs.so.1", "apt-get install libibverbs1 librdmacm1"},
		{"no provider driver", rxe.merge(files{"lib/libibverbs/librxe-rdmav34.so": ""}), true, "rdma-core libraries", false, "no provider driver", "ibverbs-providers"},
		{"build without rdma", rxe, false, "rdma support in this build", false, "without the verbs provider", "-tags rdma"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.tree)
			e.RDMASupported = tc.supported
			for _, transport := range []string{TransportRDMA, TransportAuto} {
				checks := e.Initiator(context.Background(), InitiatorOptions{Transport: transport, Device: DeviceNone, HostID: "h"})
				c := find(t, checks, tc.check)
				want(t, c, tc.ok, tc.detail, tc.fix)
				if c.Needed != (transport == TransportRDMA) {
					t.Errorf("--transport %s: %s needed %v", transport, c.Name, c.Needed)
				}
			}
		})
	}
}

// TestNoRDMAChecksForTCP: with --transport tcp nothing of RDMA is checked.
func TestNoRDMAChecksForTCP(t *testing.T) {
	e := newEnv(t, files{})
	checks := e.Initiator(context.Background(), InitiatorOptions{Transport: TransportTCP, Device: DeviceNone, HostID: "h"})
	for _, c := range checks {
		if strings.HasPrefix(c.Name, "rdma") || c.Name == "memlock limit" {
			t.Errorf("--transport tcp checks %q", c.Name)
		}
	}
	if _, needed := Failed(checks); needed != 0 {
		t.Errorf("--transport tcp --device none on an empty machine: %d needed checks failed: %+v", needed, checks)
	}
}

func TestInitiatorChecks(t *testing.T) {
	const release = "6.12.9-amd64"
	base := files{"proc/sys/kernel/osrelease": release + "\n"}
	dep := "modules/" + release + "/modules.dep"
	cases := []struct {
		name   string
		tree   files
		device string
		check  string
		ok     bool
		detail string
		fix    string
	}{
		{"nbd loaded", files{"sys/module/nbd/parameters/nbds_max": "16"}, DeviceNBD, "nbd module", true, "loaded (nbds_max 16)", ""},
		{"nbd loadable", files{dep: "kernel/drivers/block/loop.ko.xz:\nkernel/drivers/block/nbd.ko.xz:\n"}, DeviceNBD, "nbd module", false,
			"not loaded (kernel 6.12.9-amd64 has it)", "modprobe nbd nbds_max=16"},
		{"nbd missing", files{dep: "kernel/drivers/block/loop.ko:\n"}, DeviceNBD, "nbd module", false, "has no nbd module", "--nbd-listen"},
		{"nbd no modules", files{}, DeviceNBD, "nbd module", false, "has no nbd module", "CONFIG_BLK_DEV_NBD"},
		{"free nbd", files{"sys/module/nbd/x": "x", "sys/block/nbd0/pid": "42", "sys/block/nbd1/size": "0", "sys/block/nbd2/size": "0", "dev/nbd1": "x"},
			DeviceNBD, "free nbd device", true, "2 of 3 free, first", ""},
		{"no free nbd", files{"sys/module/nbd/x": "x", "sys/block/nbd0/pid": "42"}, DeviceNBD, "free nbd device", false, "none free", "rblk-attach detach"},
		{"nbd node missing", files{"sys/module/nbd/x": "x", "sys/block/nbd0/size": "0"}, DeviceNBD, "free nbd device", false, "nbd0 is missing", "udevadm trigger"},
		{"ublk loaded", files{"sys/module/ublk_drv/x": "x", "dev/ublk-control": "x"}, DeviceUblk, "ublk driver", true, "loaded", ""},
		{"ublk loadable", files{dep: "kernel/drivers/block/ublk_drv.ko.xz: kernel/x.ko\n"}, DeviceUblk, "ublk driver", true, "rblk-attach loads it", ""},
		{"ublk old kernel", files{"proc/sys/kernel/osrelease": "5.10.0-28-amd64", "modules/5.10.0-28-amd64/modules.dep": "kernel/drivers/block/nbd.ko:\n"},
			DeviceUblk, "ublk driver", false, "needs Linux >= 6.0", "--device nbd"},
		{"ublk not built", files{dep: "kernel/drivers/block/nbd.ko:\n"}, DeviceUblk, "ublk driver", false, "no ublk_drv", "CONFIG_BLK_DEV_UBLK"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, base.merge(tc.tree))
			checks := e.Initiator(context.Background(), InitiatorOptions{Transport: TransportTCP, Device: tc.device, HostID: "h"})
			c := find(t, checks, tc.check)
			want(t, c, tc.ok, tc.detail, tc.fix)
			// The driver of the device asked for is needed, the other not.
			if tc.check != "free nbd device" && c.Needed != (tc.check == map[string]string{DeviceNBD: "nbd module", DeviceUblk: "ublk driver"}[tc.device]) {
				t.Errorf("%s needed %v with --device %s", c.Name, c.Needed, tc.device)
			}
		})
	}
	// Without the module there is no free-device check.
	if checks := newEnv(t, base).Initiator(context.Background(), InitiatorOptions{Transport: TransportTCP, Device: DeviceNBD, HostID: "h"}); has(checks, "free nbd device") {
		t.Errorf("a free-device check without the nbd module: %+v", checks)
	}
	// --device none needs neither driver.
	checks := newEnv(t, base).Initiator(context.Background(), InitiatorOptions{Transport: TransportTCP, Device: DeviceNone, HostID: "h"})
	if find(t, checks, "nbd module").Needed || find(t, checks, "ublk driver").Needed {
		t.Errorf("--device none needs a driver: %+v", checks)
	}
}

// writeFile writes content with mode (umask aside) and returns its path.
func writeFile(t *testing.T, dir, name, content string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestIdentityFiles(t *testing.T) {
	dir := t.TempDir()
	secret := strings.Repeat("ab", 16)
	e := newEnv(t, files{})
	hostID := func(id, file string) Check { return e.checkHostID(id, file) }
	want(t, hostID("db-1", ""), true, `"db-1" (--host-id)`, "")
	want(t, hostID(strings.Repeat("x", 256), ""), false, "more than 255", "--host-id")
	want(t, hostID("", writeFile(t, dir, "hostid", "db-2\n", 0o644)), true, `"db-2"`, "")
	want(t, hostID("", writeFile(t, dir, "hostid-ww", "db-2\n", 0o666)), false, "mode 0666", "chmod 644")
	want(t, hostID("", writeFile(t, dir, "hostid-empty", "\n", 0o644)), false, "empty", "remove it")
	want(t, hostID("", filepath.Join(dir, "new", "hostid")), true, "the first attach creates it", "")

	secretFile := func(p string) Check { return e.checkSecretFile(p) }
	want(t, secretFile(""), true, "none", "")
	want(t, secretFile(writeFile(t, dir, "secret", secret+"\n", 0o600)), true, "holds a secret", "")
	want(t, secretFile(writeFile(t, dir, "secret-644", secret, 0o644)), false, "mode 0644", "chmod 600 ")
	want(t, secretFile(writeFile(t, dir, "secret-short", "abc", 0o600)), false, "secret of 3 bytes", "write this host's secret")
	want(t, secretFile(filepath.Join(dir, "nope")), false, "does not exist", "mode 0600")
	if !e.checkSecretFile(filepath.Join(dir, "nope")).Needed {
		t.Error("a missing --secret-file is not needed")
	}

	authFile := func(p string) Check { return e.checkAuthFile(p) }
	want(t, authFile(""), true, "none", "")
	want(t, authFile(writeFile(t, dir, "auth", "db-1 "+secret+"\ndb-2 "+secret+"\n", 0o600)), true, "2 hosts", "")
	want(t, authFile(writeFile(t, dir, "auth-640", "db-1 "+secret+"\n", 0o640)), false, "mode 0640", "chmod 600")
	want(t, authFile(writeFile(t, dir, "auth-bad", "db-1\n", 0o600)), false, "want \"HOST-ID SECRET\"", "one \"HOST-ID SECRET\" line per")
	want(t, authFile(dir), false, "not a regular file", "regular file")
}

func TestTargetID(t *testing.T) {
	e := newEnv(t, files{"proc/sys/kernel/hostname": "storage-1\n"})
	want(t, e.checkTargetID("", true), true, `"storage-1" (the host name)`, "")
	want(t, e.checkTargetID("tgt", true), true, `"tgt" (--target-id)`, "")
	e = newEnv(t, files{"proc/sys/kernel/hostname": "(none)\n"})
	want(t, e.checkTargetID("", true), false, "the host name: empty", "--target-id NAME")
}

func TestExports(t *testing.T) {
	dir := t.TempDir()
	e := newEnv(t, files{})
	img := writeFile(t, dir, "vol.img", "", 0o600)
	if err := os.Truncate(img, 1<<20); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		x      target.ExportConfig
		ok     bool
		detail string
		fix    string
	}{
		{"file", target.ExportConfig{Name: "v", Path: img}, true, "regular file, 1 MiB, read-write", ""},
		{"read-only", target.ExportConfig{Name: "v", Path: img, ReadOnly: true}, true, "read-only", ""},
		{"created", target.ExportConfig{Name: "v", Path: filepath.Join(dir, "new.img"), Size: 3 << 20}, true, "rblkd creates it, a sparse file of 3 MiB", ""},
		{"missing", target.ExportConfig{Name: "v", Path: filepath.Join(dir, "nope.img")}, false, "does not exist", "give size=BYTES"},
		{"missing read-only with size", target.ExportConfig{Name: "v", Path: filepath.Join(dir, "nope.img"), Size: 1 << 20, ReadOnly: true}, false, "does not exist", "create it"},
		{"no folder", target.ExportConfig{Name: "v", Path: filepath.Join(dir, "no", "dir", "new.img"), Size: 1 << 20}, false, "cannot create it", "create the folder"},
		{"folder", target.ExportConfig{Name: "v", Path: dir}, false, "is a folder", "regular file or a block device"},
		{"char device", target.ExportConfig{Name: "v", Path: "/dev/null"}, false, "character device", "regular file or a block device"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checks := e.checkExport(tc.x)
			want(t, checks[0], tc.ok, tc.detail, tc.fix)
			if !checks[0].Needed {
				t.Errorf("%s is not needed", checks[0].Name)
			}
		})
	}
	// The space check: the sparse file's unallocated part against the free
	// space of its file system; a warning only.
	if c := e.checkExport(target.ExportConfig{Name: "v", Path: img}); len(c) != 2 || c[1].Name != "export v space" {
		t.Fatalf("want an export and a space check, got %+v", c)
	} else {
		want(t, c[1], true, "of 1 MiB allocated", "")
	}
	c := e.checkSpace("v", dir, 1<<62, 0)
	want(t, c, false, "4 EiB", "fallocate -l")
	if c.Needed {
		t.Error("the space check is needed")
	}
}

func TestCacheMemory(t *testing.T) {
	e := newEnv(t, files{"proc/meminfo": "MemTotal:        2000000 kB\nMemFree:          100000 kB\nMemAvailable:    1048576 kB\n"})
	want(t, e.checkCacheMemory(256<<20), true, "--cache-size 256 MiB; 1 GiB available", "")
	want(t, e.checkCacheMemory(4<<30), false, "--cache-size 4 GiB; 1 GiB available", "lower --cache-size")
	want(t, newEnv(t, files{"proc/meminfo": "MemTotal: 1 kB\n"}).checkCacheMemory(1), false, "no MemAvailable", "")
}

// listener listens on a free loopback port and returns it and its port
// number.
func listener(t *testing.T) (net.Listener, int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln, ln.Addr().(*net.TCPAddr).Port
}

// owning is a /proc where process 42, called comm, listens on port.
func owning(port int, comm string) files {
	return files{
		"proc/net/tcp": "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n" +
			fmt.Sprintf("   0: 0100007F:%04X 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 31337 1 0000000000000000 100 0 0 10 0\n", port),
		"proc/42/comm":   comm + "\n",
		"proc/42/fd/3":   "->socket:[31337]",
		"proc/42/fd/0":   "->/dev/null",
		"proc/7/fd/3":    "->socket:[999]",
		"proc/self/comm": "doctor",
	}
}

func TestListen(t *testing.T) {
	ctx := context.Background()
	_, busy := listener(t)
	ln, _ := listener(t)
	freeAddr := ln.Addr().String()
	ln.Close()
	busyAddr := fmt.Sprintf("127.0.0.1:%d", busy)
	cases := []struct {
		name   string
		tree   files
		o      TargetOptions
		ok     bool
		detail string
		fix    string
	}{
		{"free", nil, TargetOptions{Transport: TransportTCP, Listen: freeAddr}, true, "free", ""},
		{"ours", owning(busy, "rblkd"), TargetOptions{Transport: TransportTCP, Listen: busyAddr}, true, "rblkd (pid 42) serves on it already", ""},
		{"someone else's", owning(busy, "nginx"), TargetOptions{Transport: TransportTCP, Listen: busyAddr}, false, "in use by nginx (pid 42)", "choose another --listen"},
		{"unknown owner", nil, TargetOptions{Transport: TransportTCP, Listen: busyAddr}, false, "in use by another process", "ss -ltnp"},
		{"no such address", nil, TargetOptions{Transport: TransportTCP, Listen: "192.0.2.77:7480"}, false, "assign", "ip -br addr"},
		{"refused without auth", nil, TargetOptions{Transport: TransportTCP, ListenErr: errors.New("--listen 10.0.0.1:7480 is not a loopback address, and rblkd has no --auth-file")},
			false, "not a loopback address", "--auth-file"},
		{"rdma: a RoCE address", rxe, TargetOptions{Transport: TransportRDMA, Listen: "192.0.2.1:7480"}, true, "192.0.2.1 is GID 1 of rxe0/1 (RoCE v2, dummy0)", ""},
		{"rdma: wildcard", rxe, TargetOptions{Transport: TransportRDMA, Listen: ":7480"}, true, "every address", ""},
		{"rdma: another host's address", rxe, TargetOptions{Transport: TransportRDMA, Listen: "198.51.100.7:7480"}, false,
			"198.51.100.7 is no address of an RDMA port (their RoCE v2 addresses: 192.0.2.1)", "interface under the RDMA device"},
		{"rdma: loopback", rxe, TargetOptions{Transport: TransportRDMA, Listen: "127.0.0.1:7480"}, true, "rdma_cm binds it to the first RDMA device", ""},
		{"rdma: no device", nil, TargetOptions{Transport: TransportRDMA, Listen: "192.0.2.1:7480"}, false, "no RDMA device", "rdma link add"},
		{"auto with a device: rdma", rxe, TargetOptions{Transport: TransportAuto, Listen: "192.0.2.1:7480"}, true, "GID 1 of rxe0/1", ""},
		{"auto without a device: tcp", nil, TargetOptions{Transport: TransportAuto, Listen: freeAddr}, true, "free", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newEnv(t, tc.tree).checkListen(ctx, tc.o)
			want(t, c, tc.ok, tc.detail, tc.fix)
			if !c.Needed {
				t.Error("the listen check is not needed")
			}
		})
	}
}

func TestTargetReachable(t *testing.T) {
	ctx := context.Background()
	ln, port := listener(t)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	e := newEnv(t, files{})
	want(t, e.checkTarget(ctx, InitiatorOptions{Transport: TransportTCP, Target: fmt.Sprintf("127.0.0.1:%d", port)}), true, "tcp: connected", "")
	closed, cport := listener(t)
	closed.Close()
	c := e.checkTarget(ctx, InitiatorOptions{Transport: TransportTCP, Target: fmt.Sprintf("127.0.0.1:%d", cport)})
	want(t, c, false, "connection refused", "start rblkd there")
	if !c.Needed {
		t.Error("the target check is not needed")
	}
}

func TestClock(t *testing.T) {
	e := newEnv(t, files{})
	want(t, e.checkClock(), true, "synchronized (fixture)", "")
	e.Clock = func() (bool, string, error) { return false, "not synchronized (STA_UNSYNC)", nil }
	c := e.checkClock()
	want(t, c, false, "STA_UNSYNC", "timedatectl set-ntp true")
	if c.Needed {
		t.Error("the clock check is needed")
	}
}

// TestTargetNeeded: the whole rblkd run on a fixture machine without RDMA:
// --transport rdma fails, tcp passes.
func TestTargetNeeded(t *testing.T) {
	dir := t.TempDir()
	tree := files{"proc/meminfo": "MemAvailable: 4194304 kB\n", "proc/sys/kernel/hostname": "t\n"}
	ln, _ := listener(t)
	addr := ln.Addr().String()
	ln.Close()
	o := TargetOptions{Listen: addr, CacheSize: 256 << 20, Exports: []target.ExportConfig{{Name: "v", Path: filepath.Join(dir, "v.img"), Size: 1 << 20}}}
	for _, tc := range []struct {
		transport string
		failed    bool
	}{{TransportTCP, false}, {TransportAuto, false}, {TransportRDMA, true}} {
		o.Transport = tc.transport
		checks := newEnv(t, tree).Target(context.Background(), o)
		var buf bytes.Buffer
		err := Report(&buf, checks, false)
		if tc.failed != errors.Is(err, ErrNeededFailed) {
			t.Errorf("--transport %s: Report returned %v:\n%s", tc.transport, err, buf.String())
		}
		if tc.transport != TransportTCP && !has(checks, "rdma devices") {
			t.Errorf("--transport %s does not check the RDMA devices", tc.transport)
		}
	}
	o.Exports = nil
	o.Transport = TransportTCP
	want(t, find(t, newEnv(t, tree).Target(context.Background(), o), "exports"), false, "none given", "--export NAME=PATH")
}

func TestReport(t *testing.T) {
	checks := []Check{
		{Name: "good", OK: true, Needed: true, Detail: "fine"},
		{Name: "warned", Detail: "meh", Fix: "do this"},
		{Name: "broken", Needed: true, Detail: "gone", Fix: "do that"},
	}
	var buf bytes.Buffer
	err := Report(&buf, checks, false)
	if !errors.Is(err, ErrNeededFailed) || !strings.Contains(err.Error(), "1 of 3") {
		t.Errorf("Report: %v, want ErrNeededFailed, 1 of 3", err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	wantLines := []string{`^✔ OK +good +fine$`, `^! WARN +warned +meh$`, `^ +fix: do this$`, `^✘ FAIL +broken +gone$`, `^ +fix: do that$`,
		`^2 of 3 checks failed, 1 of them needed: fix those first$`}
	if len(lines) != len(wantLines) {
		t.Fatalf("table:\n%s\nwant %d lines", buf.String(), len(wantLines))
	}
	for i, w := range wantLines {
		if !regexp.MustCompile(w).MatchString(lines[i]) {
			t.Errorf("line %d %q does not match %s", i, lines[i], w)
		}
	}

	buf.Reset()
	if err := Report(&buf, checks[:2], true); err != nil {
		t.Errorf("Report without a needed failure: %v", err)
	}
	var got []map[string]any
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("--json output %q: %v", buf.String(), err)
	}
	if len(got) != 2 {
		t.Fatalf("--json: %d checks, want 2", len(got))
	}
	for _, c := range got {
		for _, k := range []string{"name", "ok", "needed", "detail", "fix"} {
			if _, ok := c[k]; !ok {
				t.Errorf("--json check %v lacks %q", c, k)
			}
		}
	}
	if got[1]["name"] != "warned" || got[1]["ok"] != false || got[1]["fix"] != "do this" {
		t.Errorf("--json second check: %v", got[1])
	}
	buf.Reset()
	if err := Report(&buf, nil, true); err != nil || strings.TrimSpace(buf.String()) != "[]" {
		t.Errorf("no checks as JSON: %q, %v; want []", buf.String(), err)
	}
}
