package doctor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/safeopen"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/providers"
)

// Devices of rblk-attach doctor --device.
const (
	DeviceNBD  = "nbd"
	DeviceUblk = "ublk"
	DeviceNone = "none"
)

// ParseDevice checks a --device value of rblk-attach doctor.
func ParseDevice(s string) (string, error) {
	switch s {
	case DeviceNBD, DeviceUblk, DeviceNone:
		return s, nil
	}
	return "", fmt.Errorf("--device %q: want nbd, ublk or none (an NBD socket, --nbd-listen)", s)
}

// InitiatorOptions are what `rblk-attach doctor` checks.
type InitiatorOptions struct {
	// Transport is tcp, rdma or auto.
	Transport string
	// Device is nbd (/dev/nbdN), ublk (/dev/ublkbN) or none (--nbd-listen).
	Device string
	// HostID is --host-id; HostIDFile holds it when HostID is "".
	HostID, HostIDFile string
	// SecretFile is --secret-file ("": none).
	SecretFile string
	// Target, if not "", is dialed (HOST:PORT) within DialTimeout.
	Target      string
	DialTimeout time.Duration
}

// initiatorBuffers is what rblk-attach registers: the IO buffers
// (initiator.DefaultPoolSize) and receive buffers, for the memlock check.
const initiatorBuffers = 80 << 20

// Initiator runs the checks of rblk-attach.
func (e Env) Initiator(ctx context.Context, o InitiatorOptions) []Check {
	var out []Check
	if run, needed := rdmaWanted(o.Transport); run {
		out = append(out, e.rdmaChecks(needed, initiatorBuffers, "IO and receive buffers")...)
	}
	release, _ := readTrim(e.proc("sys", "kernel", "osrelease"))
	nbd := e.checkNBDModule(release, o.Device == DeviceNBD)
	out = append(out, nbd)
	if nbd.OK {
		out = append(out, e.checkFreeNBD())
	}
	out = append(out, e.checkUblk(release, o.Device == DeviceUblk))
	out = append(out, e.checkHostID(o.HostID, o.HostIDFile))
	out = append(out, e.checkSecretFile(o.SecretFile))
	if o.Target != "" {
		out = append(out, e.checkTarget(ctx, o))
	}
	out = append(out, e.checkClock())
	return out
}

// moduleDep reports whether modules.dep of the kernel release lists
// module (nbd, ublk_drv), compressed or not.
func (e Env) moduleDep(release, module string) (bool, error) {
	b, err := os.ReadFile(filepath.Join(e.ModulesRoot, release, "modules.dep"))
	if err != nil {
		return false, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		path, _, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		base := filepath.Base(path)
		for _, ext := range []string{".ko", ".ko.xz", ".ko.zst", ".ko.gz"} {
			if base == module+ext {
				return true, nil
			}
		}
	}
	return false, nil
}

// checkNBDModule: the nbd driver is loaded (rblk-attach does not load it).
func (e Env) checkNBDModule(release string, needed bool) Check {
	c := Check{Name: "nbd module", Needed: needed}
	if _, err := os.Stat(e.sys("module", "nbd")); err == nil {
		c.OK, c.Detail = true, "loaded"
		if n, err := readTrim(e.sys("module", "nbd", "parameters", "nbds_max")); err == nil {
			c.Detail += " (nbds_max " + n + ")"
		}
		return c
	}
	ok, err := e.moduleDep(release, "nbd")
	switch {
	case ok:
		c.Detail = fmt.Sprintf("not loaded (kernel %s has it)", release)
		c.Fix = "modprobe nbd nbds_max=16 (to load it at boot: echo nbd > /etc/modules-load.d/rblk.conf)"
	case err != nil && !os.IsNotExist(err):
		c.Detail = fmt.Sprintf("not loaded, and %v", err)
		c.Fix = "modprobe nbd nbds_max=16"
	default:
		c.Detail = fmt.Sprintf("not loaded, and kernel %s has no nbd module (none in %s)", release, filepath.Join(e.ModulesRoot, release, "modules.dep"))
		c.Fix = "install the modules of kernel " + release + " (Debian: its linux-image package), or boot a kernel with CONFIG_BLK_DEV_NBD, then modprobe nbd nbds_max=16; " +
			"or attach with --nbd-listen instead of --device"
	}
	return c
}

// checkFreeNBD: a /dev/nbdN without a server. A warning: the kernel adds
// a device when an attach finds none free.
func (e Env) checkFreeNBD() Check {
	c := Check{Name: "free nbd device"}
	ents, _ := filepath.Glob(e.sys("block", "nbd*"))
	var free []int
	for _, d := range ents {
		n, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "nbd"))
		if err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "pid")); err == nil {
			continue // attached
		}
		free = append(free, n)
	}
	sort.Ints(free)
	if len(free) == 0 {
		c.Detail = fmt.Sprintf("%d devices, none free", len(ents))
		c.Fix = "detach one (rblk-attach detach /dev/nbdN), or load nbd with more (modprobe -r nbd; modprobe nbd nbds_max=32); attach --device auto asks the kernel for a new one"
		return c
	}
	first := e.dev("nbd" + strconv.Itoa(free[0]))
	if _, err := os.Stat(first); err != nil {
		c.Detail = fmt.Sprintf("%d of %d free, but %s is missing", len(free), len(ents), first)
		c.Fix = "udev did not create the device nodes: udevadm trigger, or mount devtmpfs on /dev"
		return c
	}
	c.OK, c.Detail = true, fmt.Sprintf("%d of %d free, first %s", len(free), len(ents), first)
	return c
}

// kernelAtLeast reports whether a release ("6.12.9-amd64") is at least
// major.minor.
func kernelAtLeast(release string, major, minor int) bool {
	f := strings.FieldsFunc(release, func(r rune) bool { return r == '.' || r == '-' })
	if len(f) < 2 {
		return false
	}
	ma, err1 := strconv.Atoi(f[0])
	mi, err2 := strconv.Atoi(f[1])
	return err1 == nil && err2 == nil && (ma > major || ma == major && mi >= minor)
}

// checkUblk: the ublk driver is loaded, or loadable (rblk-attach loads
// it), on Linux >= 6.0.
func (e Env) checkUblk(release string, needed bool) Check {
	c := Check{Name: "ublk driver", Needed: needed}
	_, errMod := os.Stat(e.sys("module", "ublk_drv"))
	_, errCtl := os.Stat(e.dev("ublk-control"))
	switch {
	case errMod == nil || errCtl == nil:
		c.OK, c.Detail = true, "loaded"
		if errCtl != nil {
			c.OK, c.Detail = false, "loaded, but "+e.dev("ublk-control")+" is missing"
			c.Fix = "udev did not create it: udevadm trigger, or mount devtmpfs on /dev"
		}
		return c
	case !kernelAtLeast(release, 6, 0):
		c.Detail = fmt.Sprintf("kernel %s: ublk needs Linux >= 6.0", release)
		c.Fix = "use --device nbd (or --nbd-listen), or boot Linux >= 6.0 with CONFIG_BLK_DEV_UBLK (Debian 12: the bookworm-backports kernel)"
		return c
	}
	if ok, _ := e.moduleDep(release, "ublk_drv"); ok {
		c.OK, c.Detail = true, fmt.Sprintf("not loaded; kernel %s has it (rblk-attach loads it: modprobe ublk_drv)", release)
		return c
	}
	c.Detail = fmt.Sprintf("kernel %s has no ublk_drv module", release)
	c.Fix = "install the running kernel's modules, or boot a kernel with CONFIG_BLK_DEV_UBLK; or use --device nbd (or --nbd-listen)"
	return c
}

// checkHostID: the host ID is given, or its file holds a valid one and
// only its owner may change it, or the file can be created on first use.
func (e Env) checkHostID(id, file string) Check {
	c := Check{Name: "host id", Needed: true}
	if id != "" {
		if err := checkID(id); err != nil {
			c.Detail = "--host-id: " + err.Error()
			c.Fix = "give --host-id a printable name of at most 255 bytes"
			return c
		}
		c.OK, c.Detail = true, fmt.Sprintf("%q (--host-id)", id)
		return c
	}
	c.Name = "host id " + file
	st, err := os.Stat(file)
	if os.IsNotExist(err) {
		dir := filepath.Dir(file)
		for {
			if _, err := os.Stat(dir); err == nil || dir == filepath.Dir(dir) {
				break
			}
			dir = filepath.Dir(dir)
		}
		if err := unix.Access(dir, unix.W_OK|unix.X_OK); err != nil {
			// Attach still works, with a random ID per run.
			c.Needed = false
			c.Detail = fmt.Sprintf("does not exist, and it cannot be created (%s: %v): each attach gets a random host ID, so a restart is not recognized as the same host", dir, err)
			c.Fix = "run as root (it creates " + file + " on first use), or give --host-id"
			return c
		}
		c.OK, c.Detail = true, "does not exist: the first attach creates it with a random UUID"
		return c
	}
	if err != nil {
		c.Detail = err.Error()
		c.Fix = "run as root, or give --host-id"
		return c
	}
	if st.Mode().Perm()&0o022 != 0 {
		c.Detail = fmt.Sprintf("mode %04o: others may change this host's identity", st.Mode().Perm())
		c.Fix = "chmod 644 " + file
		return c
	}
	if uid, ok := owner(st); ok && uid != 0 && uid != e.UID {
		c.Detail = fmt.Sprintf("owned by uid %d, not root or this user", uid)
		c.Fix = "chown root:root " + file
		return c
	}
	b, _, err := safeopen.ReadFile(file, 64<<10) // (a FIFO there: refused, never waited on)
	if err != nil {
		c.Detail = err.Error()
		c.Fix = "run as root, or give --host-id"
		if errors.Is(err, safeopen.ErrKind) {
			c.Fix = "remove it (the next attach writes a random UUID into a regular file), or give --host-id"
		}
		return c
	}
	id = strings.TrimSpace(string(b))
	if err := checkID(id); err != nil {
		c.Detail = "its host ID: " + err.Error()
		c.Fix = "write a printable name of at most 255 bytes into it (or remove it: the next attach writes a random UUID)"
		return c
	}
	c.OK, c.Detail = true, fmt.Sprintf("%q", id)
	return c
}

// checkSecretFile: the secret file is private and holds a secret.
func (e Env) checkSecretFile(path string) Check {
	c := Check{Name: "secret file"}
	if path == "" {
		c.OK, c.Detail = true, "none (--secret-file): only targets without --auth-file accept this host"
		return c
	}
	c.Name, c.Needed = "secret file "+path, true
	c, ok := e.checkPrivateFile(c, path, "--secret-file")
	if !ok {
		return c
	}
	if _, err := auth.ReadSecret(path); err != nil {
		c.Detail = err.Error()
		c.Fix = "write this host's secret into it, as the target's --auth-file has it (see README, Security)"
		return c
	}
	c.OK, c.Detail = true, "mode 0600, holds a secret"
	return c
}

// checkTarget: the target answers a connection on the transport.
func (e Env) checkTarget(ctx context.Context, o InitiatorOptions) Check {
	c := Check{Name: "target " + o.Target, Needed: true}
	timeout := o.DialTimeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	useRDMA := o.Transport == TransportRDMA
	if o.Transport == TransportAuto {
		devs, _ := e.rdmaDevices()
		useRDMA = len(devs) > 0 && e.RDMASupported
	}
	if !useRDMA {
		conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", o.Target)
		if err != nil {
			c.Detail = fmt.Sprintf("tcp: %v", err)
			c.Fix = "start rblkd there (systemctl status rblkd), check the address and port and the firewall between the hosts"
			return c
		}
		conn.Close()
		c.OK, c.Detail = true, "tcp: connected"
		return c
	}
	p, _, err := providers.Open(TransportRDMA, nil)
	if err != nil {
		c.Detail = err.Error()
		c.Fix = "see the rdma checks above"
		return c
	}
	conn, err := p.Dial(ctx, o.Target, nil)
	var rej *transport.RejectError
	switch {
	case errors.As(err, &rej):
		c.OK, c.Detail = true, "rdma: the target answered (and refused an empty connect, as it should)"
	case err != nil:
		c.Detail = fmt.Sprintf("rdma: %v", err)
		c.Fix = "start rblkd there with --transport rdma; check the address is on the target's RDMA interface, the route to it (ip route get ADDR) and the MTU on the way"
	default:
		conn.Close()
		c.OK, c.Detail = true, "rdma: connected"
	}
	return c
}
