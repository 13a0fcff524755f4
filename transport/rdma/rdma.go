package rdma

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// SysfsDir is where the kernel lists RDMA devices.
const SysfsDir = "/sys/class/infiniband"

// Private data limits of the RDMA CM over InfiniBand and RoCE. The reject
// carries one length byte of its own.
const (
	MaxConnectPrivateData = 56
	MaxAcceptPrivateData  = 196
	MaxRejectPrivateData  = 147
)

// BusyPollEnv names the environment variable that turns on busy polling
// when Options.BusyPoll is zero: "1" spins DefaultBusyPoll, a Go duration
// ("20us") spins that long, "0" or empty does not spin.
const BusyPollEnv = "RBLK_RDMA_BUSY_POLL"

// DefaultBusyPoll is the spin of RBLK_RDMA_BUSY_POLL=1.
const DefaultBusyPoll = 50 * time.Microsecond

// Options tune the verbs provider. Zero fields take their defaults.
type Options struct {
	// SendQueueDepth and RecvQueueDepth size each connection's queues
	// (default 1024 each, capped by the device's max_qp_wr).
	SendQueueDepth int
	RecvQueueDepth int
	// MaxReadsInFlight bounds the RDMA READs a connection issues at once
	// (its initiator depth) and serves for its peer (its responder
	// resources). Default: what the device allows (max_qp_init_rd_atom,
	// max_qp_rd_atom), at most 255; each side takes the smaller of its own
	// value and the peer's.
	MaxReadsInFlight int
	// BusyPoll, when positive, makes Poll spin on the completion queue for
	// up to that long before it arms the queue and sleeps on the completion
	// channel. Default: from RBLK_RDMA_BUSY_POLL.
	BusyPoll time.Duration
	// ResolveTimeout bounds address and route resolution of Dial (default
	// 2s; the context bounds it too).
	ResolveTimeout time.Duration
	// Logger gets which device, port and GID each connection uses (debug),
	// and failed work requests with the verbs status text (warn). Default:
	// no logging.
	Logger *zap.Logger
}

func (o Options) withDefaults() (Options, error) {
	if o.SendQueueDepth <= 0 {
		o.SendQueueDepth = 1024
	}
	if o.RecvQueueDepth <= 0 {
		o.RecvQueueDepth = 1024
	}
	if o.MaxReadsInFlight <= 0 || o.MaxReadsInFlight > 255 {
		o.MaxReadsInFlight = 255
	}
	if o.BusyPoll == 0 {
		d, err := busyPollFromEnv(os.Getenv(BusyPollEnv))
		if err != nil {
			return o, err
		}
		o.BusyPoll = d
	}
	if o.ResolveTimeout <= 0 {
		o.ResolveTimeout = 2 * time.Second
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o, nil
}

func busyPollFromEnv(v string) (time.Duration, error) {
	switch v {
	case "", "0", "false", "no":
		return 0, nil
	case "1", "true", "yes":
		return DefaultBusyPoll, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("%s=%q: want 1, 0 or a duration such as 20us", BusyPollEnv, v)
	}
	return d, nil
}

// Devices lists the RDMA devices the kernel knows (rxe0, mlx5_0, ...).
func Devices() []string {
	entries, err := os.ReadDir(SysfsDir)
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		out = append(out, filepath.Base(e.Name()))
	}
	sort.Strings(out)
	return out
}

// DeviceAddrs lists the IP addresses of the network interfaces under the
// RDMA device dev (the netdev of a RoCE or iWARP port, as the GID table
// names them), IPv4 first: the addresses to listen on or dial to use dev.
func DeviceAddrs(dev string) ([]netip.Addr, error) {
	ports, err := filepath.Glob(filepath.Join(SysfsDir, dev, "ports", "*", "gid_attrs", "ndevs", "*"))
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var v4, v6 []netip.Addr
	for _, p := range ports {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		name := strings.TrimSpace(string(b))
		if name == "" || seen[name] {
			continue
		}
		seen[name] = true
		ifi, err := net.InterfaceByName(name)
		if err != nil {
			continue
		}
		addrs, err := ifi.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			pfx, err := netip.ParsePrefix(a.String())
			if err != nil {
				continue
			}
			ip := pfx.Addr().Unmap()
			switch {
			case ip.Is4():
				v4 = append(v4, ip)
			case !ip.IsLinkLocalUnicast():
				v6 = append(v6, ip)
			}
		}
	}
	if len(seen) == 0 {
		return nil, fmt.Errorf("RDMA device %s: no network interface in %s (an InfiniBand port needs IPoIB)", dev, SysfsDir)
	}
	return append(v4, v6...), nil
}

// New returns the verbs provider. Without an RDMA device it fails with
// transport.ErrNoDevice and says what to do; in a build without the tag
// rdma it fails with transport.ErrUnsupported.
func New() (transport.Provider, error) { return NewWithOptions(Options{}) }

// NewWithOptions is New with options.
func NewWithOptions(opts Options) (transport.Provider, error) {
	devs := Devices()
	if len(devs) == 0 {
		err := fmt.Errorf("%w: %s lists none; load a driver (for Soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev IFACE) or use --transport tcp", transport.ErrNoDevice, SysfsDir)
		if !Supported {
			err = fmt.Errorf("%w (and %w: %s)", err, transport.ErrUnsupported, unsupportedHint)
		}
		return nil, err
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	return newProvider(devs, opts)
}

const unsupportedHint = "built without RDMA support: rebuild with -tags rdma (needs libibverbs-dev and librdmacm-dev)"

// VendorErrString explains the VendorErr of a failed completion of this
// provider: the ibv_wc_status (in its top 8 bits) as ibv_wc_status_str
// says it, and the device's vendor_err (the low 24 bits).
func VendorErrString(v uint32) string {
	st := v >> 24
	text := verbs.StatusString(st)
	if text == "unknown" {
		text = fmt.Sprintf("ibv_wc_status %d", st)
	}
	return fmt.Sprintf("%s (vendor_err %#x)", text, v&0xffffff)
}
