// Package providers picks a transport provider by name, as the command-line
// tools' --transport flag names it.
package providers

import (
	"fmt"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma"
	"github.com/rblk/rblk/transport/tcp"
)

// Names are the accepted values of --transport.
const Names = "tcp|rdma|auto"

// Open returns the provider called name: "tcp" (the software provider),
// "rdma" (verbs; fails at once without a device), or "auto" (rdma when a
// device exists, else tcp). The second result says what was chosen and why,
// for the log. log gets the chosen provider's own warnings, the verbs
// provider's as the software one's (nil: none).
func Open(name string, log *zap.Logger) (transport.Provider, string, error) {
	return open(name, log, rdmaFuncs{newProvider: rdma.NewWithOptions, devices: rdma.Devices})
}

// rdmaFuncs are the verbs provider's constructor and device list (tests
// replace them: without a device, rdma.NewWithOptions fails before it
// uses its options).
type rdmaFuncs struct {
	newProvider func(rdma.Options) (transport.Provider, error)
	devices     func() []string
}

func open(name string, log *zap.Logger, r rdmaFuncs) (transport.Provider, string, error) {
	if log == nil {
		log = zap.NewNop()
	}
	newTCP := func() transport.Provider { return tcp.NewWithOptions("tcp", tcp.Options{Logger: log}) }
	newRDMA := func() (transport.Provider, error) { return r.newProvider(rdma.Options{Logger: log}) }
	switch name {
	case "tcp":
		return newTCP(), "tcp (software RDMA emulation over TCP)", nil
	case "rdma":
		p, err := newRDMA()
		if err != nil {
			return nil, "", fmt.Errorf("--transport rdma: %w", err)
		}
		return p, fmt.Sprintf("rdma (devices %v)", r.devices()), nil
	case "auto":
		devs := r.devices()
		if len(devs) == 0 {
			return newTCP(), "tcp (auto: no RDMA device in " + rdma.SysfsDir + ")", nil
		}
		p, err := newRDMA()
		if err != nil {
			return newTCP(), fmt.Sprintf("tcp (auto: RDMA devices %v unusable: %v)", devs, err), nil
		}
		return p, fmt.Sprintf("rdma (auto: devices %v)", devs), nil
	}
	return nil, "", fmt.Errorf("--transport %q: want one of %s", name, Names)
}
