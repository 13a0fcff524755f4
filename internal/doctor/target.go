package doctor

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/safeopen"
	"github.com/rblk/rblk/target"
)

// TargetOptions are what `rblkd doctor` checks: the settings rblkd serve
// would run with.
type TargetOptions struct {
	// Transport is tcp, rdma or auto.
	Transport string
	// Listen is the address rblkd would listen on; ListenErr, if not nil,
	// is why rblkd would refuse it (a non-loopback address without
	// --auth-file).
	Listen    string
	ListenErr error
	// AuthFile is --auth-file ("": none).
	AuthFile string
	// TargetID is --target-id ("": the host name).
	TargetID string
	// Exports are the volumes to serve.
	Exports []target.ExportConfig
	// CacheSize is --cache-size in bytes.
	CacheSize int64
}

// targetBuffers is what rblkd registers beside its cache (receive buffers
// and the like), for the memlock check: a generous round figure.
const targetBuffers = 64 << 20

// Target runs the checks of rblkd.
func (e Env) Target(ctx context.Context, o TargetOptions) []Check {
	var out []Check
	runRDMA, rdmaNeeded := rdmaWanted(o.Transport)
	if runRDMA {
		out = append(out, e.rdmaChecks(rdmaNeeded, o.CacheSize+targetBuffers,
			fmt.Sprintf("--cache-size %s and %s of buffers", human(o.CacheSize), human(targetBuffers)))...)
	}
	out = append(out, e.checkListen(ctx, o))
	out = append(out, e.checkAuthFile(o.AuthFile))
	out = append(out, e.checkTargetID(o.TargetID, o.AuthFile != ""))
	if len(o.Exports) == 0 {
		out = append(out, Check{Name: "exports", Needed: true, Detail: "none given",
			Fix: "give --export NAME=PATH[,ro][,size=BYTES] for each volume to serve"})
	}
	for _, x := range o.Exports {
		out = append(out, e.checkExport(x)...)
	}
	out = append(out, e.checkCacheMemory(o.CacheSize))
	out = append(out, e.checkClock())
	return out
}

// checkListen: rblkd can listen on the address.
func (e Env) checkListen(ctx context.Context, o TargetOptions) Check {
	c := Check{Name: "listen " + o.Listen, Needed: true}
	if o.ListenErr != nil {
		c.Name = "listen"
		c.Detail = o.ListenErr.Error()
		c.Fix = "give --auth-file (see README, Security), or listen on a loopback address (--listen 127.0.0.1:7480), or --allow-unauthenticated on a network you trust"
		return c
	}
	devs, _ := e.rdmaDevices()
	if o.Transport == TransportRDMA || (o.Transport == TransportAuto && len(devs) > 0 && e.RDMASupported) {
		return e.checkRDMAListen(ctx, c, o.Listen, devs)
	}
	return e.checkTCPListen(ctx, c, o.Listen)
}

func (e Env) checkTCPListen(ctx context.Context, c Check, addr string) Check {
	if !strings.Contains(addr, ":") { // a unix socket's path
		if conn, err := (&net.Dialer{}).DialContext(ctx, "unix", addr); err == nil {
			conn.Close()
			c.Detail = "another process serves on the unix socket " + addr
			c.Fix = "stop it, or choose another --listen"
			return c
		}
		if _, err := os.Stat(filepath.Dir(addr)); err != nil {
			c.Detail = err.Error()
			c.Fix = "create the folder " + filepath.Dir(addr)
			return c
		}
		c.OK, c.Detail = true, "unix socket: nobody serves on it"
		return c
	}
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
	if err == nil {
		ln.Close()
		c.OK, c.Detail = true, "free"
		return c
	}
	c.Detail = err.Error()
	switch {
	case errors.Is(err, syscall.EADDRINUSE):
		_, p, _ := net.SplitHostPort(addr)
		port, _ := strconv.Atoi(p)
		pid, comm := e.portOwner(port)
		switch {
		case comm == "rblkd":
			c.OK, c.Detail = true, fmt.Sprintf("rblkd (pid %d) serves on it already", pid)
		case pid > 0:
			c.Detail = fmt.Sprintf("in use by %s (pid %d)", comm, pid)
			c.Fix = "stop it, or choose another --listen"
		default:
			c.Detail = "in use by another process"
			c.Fix = "find it with ss -ltnp; stop it, or choose another --listen"
		}
	case errors.Is(err, syscall.EADDRNOTAVAIL):
		c.Fix = "listen on an address of this host (ip -br addr), or on :PORT for every interface"
	case errors.Is(err, syscall.EACCES):
		c.Fix = "ports below 1024 need root: run as root, or use a higher port (the default is 7480)"
	default:
		c.Fix = "check --listen: HOST:PORT"
	}
	return c
}

// checkRDMAListen: rdma_cm can bind the address, that is, it is an
// address of an RDMA port's network interface (a RoCE v2 GID), or a
// wildcard.
func (e Env) checkRDMAListen(ctx context.Context, c Check, addr string, devs []string) Check {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		c.Detail = err.Error()
		c.Fix = "give --listen HOST:PORT"
		return c
	}
	if len(devs) == 0 {
		c.Detail = "no RDMA device to listen on"
		c.Fix = fixNoDevice
		return c
	}
	var ip netip.Addr
	if host != "" {
		if ip, err = netip.ParseAddr(host); err != nil {
			ips, lerr := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
			if lerr != nil || len(ips) == 0 {
				c.Detail = fmt.Sprintf("cannot resolve %s: %v", host, lerr)
				c.Fix = "give --listen an IP address of the RDMA interface"
				return c
			}
			ip = ips[0]
		}
		ip = ip.Unmap()
	}
	if host == "" || ip.IsUnspecified() {
		c.OK, c.Detail = true, "every address of every RDMA device"
		return c
	}
	if ip.IsLoopback() {
		c.OK, c.Detail = true, "loopback: rdma_cm binds it to the first RDMA device with an active port (initiators on this host only)"
		return c
	}
	var roce []string
	ib := false
	for _, d := range devs {
		for _, p := range e.ports(d) {
			if p.linkLayer() == "InfiniBand" {
				ib = true
				continue
			}
			for _, g := range p.gids() {
				if g.addr.Unmap() == ip {
					c.OK, c.Detail = true, fmt.Sprintf("%s is GID %d of %s (%s, %s)", ip, g.index, p, g.typ, g.netdev)
					return c
				}
				if g.typ == "RoCE v2" {
					roce = append(roce, g.addr.Unmap().String())
				}
			}
		}
	}
	if ib {
		c.OK, c.Detail = true, "an InfiniBand port: the address must be one of its IPoIB interface (not checked)"
		return c
	}
	c.Detail = fmt.Sprintf("%s is no address of an RDMA port (their RoCE v2 addresses: %s)", ip, strings.Join(roce, ", "))
	if len(roce) == 0 {
		c.Detail = fmt.Sprintf("%s is no address of an RDMA port (they have no RoCE v2 address)", ip)
	}
	c.Fix = "listen on an address of the interface under the RDMA device (ip -br addr), or on :PORT for all of them"
	return c
}

// portOwner finds the process listening on TCP port (from /proc/net/tcp
// and tcp6 and the sockets among /proc/PID/fd), or 0 and "".
func (e Env) portOwner(port int) (int, string) {
	inodes := map[string]bool{}
	for _, f := range []string{"tcp", "tcp6"} {
		fh, err := os.Open(e.proc("net", f))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
			fl := strings.Fields(sc.Text())
			if len(fl) < 10 || fl[3] != "0A" { // LISTEN
				continue
			}
			i := strings.LastIndexByte(fl[1], ':')
			if p, err := strconv.ParseUint(fl[1][i+1:], 16, 16); err == nil && int(p) == port {
				inodes["socket:["+fl[9]+"]"] = true
			}
		}
		fh.Close()
	}
	if len(inodes) == 0 {
		return 0, ""
	}
	procs, _ := os.ReadDir(e.ProcRoot)
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fds, _ := os.ReadDir(e.proc(p.Name(), "fd"))
		for _, fd := range fds {
			if l, err := os.Readlink(e.proc(p.Name(), "fd", fd.Name())); err == nil && inodes[l] {
				comm, _ := readTrim(e.proc(p.Name(), "comm"))
				return pid, comm
			}
		}
	}
	return 0, ""
}

// checkAuthFile: the auth file is private and parses.
func (e Env) checkAuthFile(path string) Check {
	c := Check{Name: "auth file", Needed: true}
	if path == "" {
		c.OK, c.Needed = true, false
		c.Detail = "none (--auth-file): rblkd serves loopback addresses only, unless --allow-unauthenticated"
		return c
	}
	c.Name = "auth file " + path
	c, ok := e.checkPrivateFile(c, path, "--auth-file")
	if !ok {
		return c
	}
	keys, err := auth.LoadKeys(path)
	if err != nil {
		c.Detail = err.Error()
		c.Fix = "write one \"HOST-ID SECRET\" line per initiator host (see README, Security)"
		return c
	}
	c.OK, c.Detail = true, fmt.Sprintf("mode 0600, %d hosts", keys.Len())
	return c
}

// checkTargetID: the target ID (--target-id or the host name) is usable.
func (e Env) checkTargetID(id string, needed bool) Check {
	c := Check{Name: "target id", Needed: needed}
	from := "--target-id"
	if id == "" {
		from = "the host name"
		h, err := readTrim(e.proc("sys", "kernel", "hostname"))
		if err != nil {
			if h, err = os.Hostname(); err != nil {
				c.Detail = "cannot read the host name: " + err.Error()
				c.Fix = "give --target-id NAME"
				return c
			}
		}
		id = h
	}
	if err := checkID(id); err != nil {
		c.Detail = fmt.Sprintf("%s: %v", from, err)
		c.Fix = "give --target-id NAME (printable, at most 255 bytes), or set the host name (hostnamectl set-hostname NAME)"
		return c
	}
	c.OK, c.Detail = true, fmt.Sprintf("%q (%s)", id, from)
	return c
}

// checkID validates a host or target ID as the protocol carries it.
func checkID(id string) error {
	switch {
	case id == "" || id == "(none)":
		return errors.New("empty")
	case len(id) > 255:
		return fmt.Errorf("%d bytes, more than 255", len(id))
	case !utf8.ValidString(id) || strings.ContainsAny(id, "\x00\n"):
		return fmt.Errorf("%q is not printable UTF-8", id)
	}
	return nil
}

// checkExport: the backing file exists (or will be created), is a regular
// file or a block device and opens as the mode needs; and, for a regular
// file, whether its file system has room for the part not yet allocated.
func (e Env) checkExport(x target.ExportConfig) []Check {
	mode := "read-write"
	flags := os.O_RDWR
	if x.ReadOnly {
		mode, flags = "read-only", os.O_RDONLY
	}
	c := Check{Name: "export " + x.Name, Needed: true}
	st, err := os.Stat(x.Path)
	if os.IsNotExist(err) {
		if x.Size <= 0 || x.ReadOnly {
			c.Detail = x.Path + " does not exist"
			c.Fix = "create it, or give size=BYTES (read-write exports) to have rblkd create it as a sparse file"
			return []Check{c}
		}
		dir := filepath.Dir(x.Path)
		if err := unix.Access(dir, unix.W_OK|unix.X_OK); err != nil {
			c.Detail = fmt.Sprintf("%s does not exist, and rblkd cannot create it in %s: %v", x.Path, dir, err)
			c.Fix = fmt.Sprintf("create the folder %s, writable by the user rblkd runs as (root)", dir)
			return []Check{c}
		}
		c.OK, c.Detail = true, fmt.Sprintf("%s does not exist: rblkd creates it, a sparse file of %s (%s)", x.Path, human(x.Size), mode)
		return []Check{c, e.checkSpace(x.Name, dir, x.Size, 0)}
	}
	if err != nil {
		c.Detail = err.Error()
		c.Fix = "run as the user rblkd runs as (root)"
		return []Check{c}
	}
	kind := "regular file"
	switch m := st.Mode(); {
	case m.IsRegular():
	case m&os.ModeDevice != 0 && m&os.ModeCharDevice == 0:
		kind = "block device"
	default:
		c.Detail = fmt.Sprintf("%s is a %s: want a regular file or a block device", x.Path, fileType(m))
		c.Fix = "export a regular file or a block device"
		return []Check{c}
	}
	f, _, err := safeopen.Open(x.Path, flags, 0, safeopen.Regular|safeopen.BlockDevice) // never blocks
	if err != nil {
		c.Detail = fmt.Sprintf("cannot open it %s: %v", mode, err)
		switch {
		case errors.Is(err, syscall.EROFS):
			c.Fix = "its file system is read-only: export it with ,ro"
		case errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM):
			c.Fix = fmt.Sprintf("let the user rblkd runs as open it %s (chmod, chown), or run rblkd as root", mode)
		case errors.Is(err, syscall.EBUSY):
			c.Fix = "another process holds the device exclusively (mounted? ls /sys/block/*/holders)"
		default:
			c.Fix = "check the path and the device"
		}
		return []Check{c}
	}
	size := st.Size()
	if kind == "block device" {
		if end, err := f.Seek(0, 2); err == nil {
			size = end
		}
	}
	f.Close()
	c.OK, c.Detail = true, fmt.Sprintf("%s: %s, %s, %s", x.Path, kind, human(size), mode)
	if kind != "regular file" || x.ReadOnly {
		return []Check{c}
	}
	var alloc int64
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		alloc = s.Blocks * 512
	}
	return []Check{c, e.checkSpace(x.Name, filepath.Dir(x.Path), size, alloc)}
}

func fileType(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "folder"
	case m&os.ModeCharDevice != 0:
		return "character device"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeNamedPipe != 0:
		return "named pipe"
	}
	return m.Type().String()
}

// checkSpace: the file system of dir has room for the size-alloc bytes of
// a sparse file not allocated yet, or writes may fail with ENOSPC. A
// warning, never needed: thin provisioning is a choice.
func (e Env) checkSpace(name, dir string, size, alloc int64) Check {
	c := Check{Name: "export " + name + " space"}
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		c.Detail = fmt.Sprintf("statfs %s: %v", dir, err)
		c.Fix = "check the file system of " + dir
		return c
	}
	free := int64(fs.Bavail) * int64(fs.Bsize)
	want := max(size-alloc, 0)
	c.Detail = fmt.Sprintf("%s of %s allocated; %s free on the file system of %s", human(min(alloc, size)), human(size), human(free), dir)
	if free >= want {
		c.OK = true
		return c
	}
	c.Fix = fmt.Sprintf("the volume may outgrow its file system (writes then fail): free %s there, or allocate the file in full (fallocate -l %d FILE)", human(want-free), size)
	return c
}

// checkCacheMemory: MemAvailable holds the cache.
func (e Env) checkCacheMemory(cache int64) Check {
	c := Check{Name: "memory for the cache", Needed: true}
	b, err := os.ReadFile(e.proc("meminfo"))
	if err != nil {
		c.Detail = err.Error()
		c.Fix = "no /proc/meminfo: mount proc"
		return c
	}
	for _, l := range strings.Split(string(b), "\n") {
		v, ok := strings.CutPrefix(l, "MemAvailable:")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			break
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			break
		}
		avail := kb << 10
		c.Detail = fmt.Sprintf("--cache-size %s; %s available", human(cache), human(avail))
		if avail >= cache {
			c.OK = true
			return c
		}
		c.Fix = "lower --cache-size, or free memory: the cache is allocated and pinned at start"
		return c
	}
	c.Detail = "no MemAvailable in " + e.proc("meminfo")
	c.Fix = "a kernel >= 3.14 shows it"
	return c
}
