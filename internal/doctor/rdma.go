package doctor

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// fixNoDevice is what to do without an RDMA device.
const fixNoDevice = "load the driver of your RDMA NIC (mlx5_ib, irdma, bnxt_re, ...), or for Soft-RoCE on an Ethernet interface: " +
	"apt-get install rdma-core iproute2; modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0 (your interface); " +
	"or use --transport tcp"

// port is one port of an RDMA device, as sysfs shows it.
type port struct {
	dev, num, dir string
}

func (p port) String() string { return p.dev + "/" + p.num }

// rdmaDevices lists the RDMA devices in /sys/class/infiniband.
func (e Env) rdmaDevices() ([]string, error) {
	ents, err := os.ReadDir(e.sys("class", "infiniband"))
	if err != nil {
		return nil, err
	}
	var devs []string
	for _, d := range ents {
		devs = append(devs, d.Name())
	}
	sort.Strings(devs)
	return devs, nil
}

func (e Env) ports(dev string) []port {
	ents, _ := os.ReadDir(e.sys("class", "infiniband", dev, "ports"))
	var ps []port
	for _, p := range ents {
		ps = append(ps, port{dev: dev, num: p.Name(), dir: e.sys("class", "infiniband", dev, "ports", p.Name())})
	}
	return ps
}

// gid is one entry of a port's GID table.
type gid struct {
	index  int
	addr   netip.Addr
	typ    string // "RoCE v2", "IB/RoCE v1"
	netdev string
}

// gids reads the non-zero entries of a port's GID table.
func (p port) gids() []gid {
	ents, _ := os.ReadDir(filepath.Join(p.dir, "gids"))
	var out []gid
	for _, ent := range ents {
		i, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		s, err := readTrim(filepath.Join(p.dir, "gids", ent.Name()))
		if err != nil {
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil || a.IsUnspecified() {
			continue
		}
		g := gid{index: i, addr: a}
		g.typ, _ = readTrim(filepath.Join(p.dir, "gid_attrs", "types", ent.Name()))
		g.netdev, _ = readTrim(filepath.Join(p.dir, "gid_attrs", "ndevs", ent.Name()))
		out = append(out, g)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].index < out[j].index })
	return out
}

// netdev is the network interface under a RoCE port ("" for InfiniBand).
func (p port) netdev() string {
	for _, g := range p.gids() {
		if g.netdev != "" {
			return g.netdev
		}
	}
	return ""
}

func (p port) linkLayer() string {
	s, _ := readTrim(filepath.Join(p.dir, "link_layer"))
	return s
}

// rdmaChecks checks the RDMA stack; the checks are needed when needed.
// mem is the memory rblkd or rblk-attach registers, for the memlock
// check; what names it ("--cache-size 256M and buffers").
func (e Env) rdmaChecks(needed bool, mem int64, what string) []Check {
	var out []Check
	add := func(c Check) { c.Needed = needed; out = append(out, c) }
	add(e.checkBuild())
	devs, err := e.rdmaDevices()
	c := Check{Name: "rdma devices"}
	switch {
	case err != nil && os.IsNotExist(err):
		c.Detail = "none: " + e.sys("class", "infiniband") + " does not exist (no RDMA driver loaded)"
		c.Fix = fixNoDevice
	case err != nil:
		c.Detail = err.Error()
		c.Fix = "run the doctor as root"
	case len(devs) == 0:
		c.Detail = "none in " + e.sys("class", "infiniband")
		c.Fix = fixNoDevice
	default:
		c.OK, c.Detail = true, strings.Join(devs, ", ")
	}
	add(c)
	for _, d := range devs {
		for _, p := range e.ports(d) {
			add(e.checkPortState(p))
			add(e.checkGIDs(p))
			if p.linkLayer() != "InfiniBand" {
				add(e.checkMTU(p))
			}
		}
	}
	add(e.checkDevNodes())
	add(e.checkMemlock(mem, what))
	return out
}

// checkBuild: the binary has the verbs provider, and rdma-core's
// libraries and a driver for libibverbs are installed.
func (e Env) checkBuild() Check {
	c := Check{Name: "rdma-core libraries"}
	if !e.RDMASupported {
		c.Name = "rdma support in this build"
		c.Detail = "built without the verbs provider (build tag rdma)"
		c.Fix = "apt-get install libibverbs-dev librdmacm-dev, then rebuild: make build (or go build -tags rdma ./cmd/...)"
		return c
	}
	var missing, found []string
	for _, lib := range []string{"libibverbs.so.1", "librdmacm.so.1"} {
		if p := e.findLib(lib); p != "" {
			found = append(found, p)
		} else {
			missing = append(missing, lib)
		}
	}
	drivers := map[string]bool{} // by name: /lib/ARCH is often /usr/lib/ARCH
	for _, d := range e.LibDirs {
		m, _ := filepath.Glob(filepath.Join(d, "libibverbs", "lib*-rdmav*.so"))
		for _, p := range m {
			drivers[filepath.Base(p)] = true
		}
	}
	switch {
	case len(missing) > 0:
		c.Detail = "missing " + strings.Join(missing, ", ") + " in " + strings.Join(e.LibDirs, " ")
		c.Fix = "apt-get install libibverbs1 librdmacm1 ibverbs-providers (rdma-core)"
	case len(drivers) == 0:
		c.Detail = "found " + strings.Join(found, ", ") + ", but no provider driver (libibverbs/lib*-rdmav*.so): libibverbs sees no device"
		c.Fix = "apt-get install ibverbs-providers"
	default:
		c.OK = true
		c.Detail = fmt.Sprintf("%s; %d provider drivers", strings.Join(found, ", "), len(drivers))
	}
	return c
}

func (e Env) findLib(name string) string {
	for _, d := range e.LibDirs {
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// checkPortState: the port is ACTIVE, its link up.
func (e Env) checkPortState(p port) Check {
	c := Check{Name: "rdma port " + p.String()}
	state, err1 := readTrim(filepath.Join(p.dir, "state"))
	phys, err2 := readTrim(filepath.Join(p.dir, "phys_state"))
	if err1 != nil || err2 != nil {
		c.Detail = fmt.Sprintf("cannot read its state: %v", firstErr(err1, err2))
		c.Fix = "run the doctor as root; check the driver in dmesg"
		return c
	}
	c.Detail = fmt.Sprintf("state %s, phys_state %s", state, phys)
	active, linkUp := strings.HasSuffix(state, "ACTIVE"), strings.HasSuffix(phys, "LinkUp")
	nd := p.netdev()
	switch {
	case active && linkUp:
		c.OK = true
		if nd != "" {
			c.Detail += ", netdev " + nd
		}
	case !linkUp && nd != "":
		c.Fix = fmt.Sprintf("bring the link up: ip link set %s up; check the cable and the switch port", nd)
	case !linkUp:
		c.Fix = "bring the link up: check the cable and the switch port (ibstat shows the port)"
	case p.linkLayer() == "InfiniBand":
		c.Fix = "the link is up but not ACTIVE: start a subnet manager on the fabric (opensm)"
	default:
		c.Fix = fmt.Sprintf("the link is up but the port is not ACTIVE: check %s (ip link show %s) and dmesg", nd, nd)
	}
	return c
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// checkGIDs: a RoCE port has a RoCE v2 GID (an IP address of its
// netdev), which rdma_cm uses; an InfiniBand port has a GID.
func (e Env) checkGIDs(p port) Check {
	c := Check{Name: "rdma gids " + p.String()}
	gids := p.gids()
	if p.linkLayer() == "InfiniBand" {
		if len(gids) == 0 {
			c.Detail = "no GID"
			c.Fix = "the port has no GID yet: start a subnet manager on the fabric (opensm)"
			return c
		}
		c.OK, c.Detail = true, fmt.Sprintf("InfiniBand, GID %s", gids[0].addr)
		return c
	}
	var v2, v1 []string
	for _, g := range gids {
		s := g.addr.Unmap().String()
		switch g.typ {
		case "RoCE v2":
			v2 = append(v2, fmt.Sprintf("%s (index %d)", s, g.index))
		default:
			v1 = append(v1, s)
		}
	}
	nd := p.netdev()
	if nd == "" {
		nd = "IFACE"
	}
	if len(v2) == 0 {
		c.Detail = fmt.Sprintf("no RoCE v2 GID (%d RoCE v1 GIDs)", len(v1))
		c.Fix = fmt.Sprintf("give %s an IP address (ip addr add ADDR/PREFIX dev %s): RoCE v2 GIDs are made from its addresses", nd, nd)
		return c
	}
	if len(v2) > 3 {
		v2 = append(v2[:3], fmt.Sprintf("and %d more", len(v2)-3))
	}
	c.OK, c.Detail = true, "RoCE v2: "+strings.Join(v2, ", ")
	return c
}

// roceHeaders is what RoCE v2 adds to each packet of the IB MTU (Ethernet
// payload: IP, UDP, BTH, RETH, ICRC, as rxe counts it).
const roceHeaders = 80

// checkMTU: the RoCE MTU the netdev's MTU allows (the largest IB MTU,
// 256 to 4096, that fits with the headers).
func (e Env) checkMTU(p port) Check {
	c := Check{Name: "rdma mtu " + p.String()}
	nd := p.netdev()
	if nd == "" {
		c.Detail = "no network interface under the port (no GID names one)"
		c.Fix = "give the interface under the RDMA device an IP address and bring it up"
		return c
	}
	s, err := readTrim(e.sys("class", "net", nd, "mtu"))
	mtu, perr := strconv.Atoi(s)
	if err != nil || perr != nil {
		c.Detail = fmt.Sprintf("cannot read the MTU of %s: %v", nd, firstErr(err, perr))
		c.Fix = "ip link show " + nd
		return c
	}
	ib := 0
	for _, m := range []int{4096, 2048, 1024, 512, 256} {
		if m <= mtu-roceHeaders {
			ib = m
			break
		}
	}
	c.Detail = fmt.Sprintf("%s mtu %d: RoCE MTU %d", nd, mtu, ib)
	if ib < 1024 {
		c.Fix = fmt.Sprintf("raise the MTU: ip link set %s mtu 1500 (9000 with jumbo frames on the switch gives RoCE MTU 4096)", nd)
		return c
	}
	c.OK = true
	if ib < 4096 {
		c.Detail += " (jumbo frames, mtu 9000 on the interface and the switch, give 4096)"
	}
	return c
}

// checkDevNodes: /dev/infiniband/uverbs* and rdma_cm exist and open.
func (e Env) checkDevNodes() Check {
	c := Check{Name: "rdma device nodes"}
	uverbs, _ := filepath.Glob(e.dev("infiniband", "uverbs*"))
	nodes := append(uverbs, e.dev("infiniband", "rdma_cm"))
	var missing, denied, ok []string
	for _, n := range nodes {
		f, err := os.OpenFile(n, os.O_RDWR, 0)
		switch {
		case err == nil:
			f.Close()
			ok = append(ok, filepath.Base(n))
		case os.IsNotExist(err):
			missing = append(missing, n)
		default:
			denied = append(denied, fmt.Sprintf("%s (%v)", n, err))
		}
	}
	switch {
	case len(uverbs) == 0 || len(missing) > 0:
		if len(uverbs) == 0 {
			missing = append([]string{e.dev("infiniband", "uverbs*")}, missing...)
		}
		c.Detail = "missing " + strings.Join(missing, ", ")
		c.Fix = "modprobe ib_uverbs rdma_ucm (rdma-core loads them at boot: apt-get install rdma-core)"
	case len(denied) > 0:
		c.Detail = "cannot open " + strings.Join(denied, ", ")
		c.Fix = "run as root, or let this user open /dev/infiniband/* (a udev rule giving them to a group it is in)"
	default:
		c.OK, c.Detail = true, "open: "+strings.Join(ok, ", ")
	}
	return c
}

// capIPCLock is the bit of CAP_IPC_LOCK in /proc/PID/status's CapEff.
const capIPCLock = 14

// checkMemlock: the process may lock mem bytes (RLIMIT_MEMLOCK, or
// CAP_IPC_LOCK, which root has, lifts it).
func (e Env) checkMemlock(mem int64, what string) Check {
	c := Check{Name: "memlock limit"}
	if st, err := os.ReadFile(e.proc("self", "status")); err == nil {
		for _, l := range strings.Split(string(st), "\n") {
			if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
				if caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err == nil && caps&(1<<capIPCLock) != 0 {
					c.OK, c.Detail = true, "not limited: CAP_IPC_LOCK (root)"
					return c
				}
			}
		}
	}
	limits, err := os.ReadFile(e.proc("self", "limits"))
	if err != nil {
		c.Detail = fmt.Sprintf("cannot read the limits: %v", err)
		c.Fix = "check ulimit -l"
		return c
	}
	for _, l := range strings.Split(string(limits), "\n") {
		rest, ok := strings.CutPrefix(l, "Max locked memory")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) < 1 {
			break
		}
		if f[0] == "unlimited" {
			c.OK, c.Detail = true, "unlimited"
			return c
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			break
		}
		c.Detail = fmt.Sprintf("%s; needs about %s (%s)", human(n), human(mem), what)
		if n >= mem {
			c.OK = true
			return c
		}
		c.Fix = "raise the memlock limit: LimitMEMLOCK=infinity in the systemd unit (the units in systemd/ have it), or ulimit -l unlimited in the shell that starts it"
		return c
	}
	c.Detail = "no \"Max locked memory\" in " + e.proc("self", "limits")
	c.Fix = "check ulimit -l"
	return c
}

// human formats a byte count: 256 MiB.
func human(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	v := float64(n) / float64(div)
	if v == float64(int64(v)) {
		return fmt.Sprintf("%d %ciB", int64(v), "KMGTPE"[exp])
	}
	return fmt.Sprintf("%.1f %ciB", v, "KMGTPE"[exp])
}

// checkClock: the clock is synchronized, so the logs of the target and
// its initiators line up. Never needed.
func (e Env) checkClock() Check {
	c := Check{Name: "clock"}
	if e.Clock == nil {
		c.Detail = "not checked"
		c.OK = true
		return c
	}
	synced, detail, err := e.Clock()
	switch {
	case err != nil:
		c.Detail = err.Error()
		c.Fix = "timedatectl shows whether the clock is synchronized"
	case !synced:
		c.Detail = detail
		c.Fix = "synchronize the clock so the logs of target and initiators line up: timedatectl set-ntp true (systemd-timesyncd), or apt-get install chrony"
	default:
		c.OK, c.Detail = true, detail
	}
	return c
}

// rdmaWanted says whether the RDMA checks run, and whether they are
// needed, for a --transport value.
func rdmaWanted(transport string) (run, needed bool) {
	switch transport {
	case TransportRDMA:
		return true, true
	case TransportAuto:
		return true, false
	}
	return false, false
}
