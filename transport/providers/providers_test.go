package providers

import (
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma"
	"github.com/rblk/rblk/transport/tcp"
)

// fakeRDMA records the options the verbs provider was made with.
type fakeRDMA struct {
	devs []string
	err  error
	got  []rdma.Options
}

func (f *fakeRDMA) funcs() rdmaFuncs {
	return rdmaFuncs{
		newProvider: func(o rdma.Options) (transport.Provider, error) {
			f.got = append(f.got, o)
			if f.err != nil {
				return nil, f.err
			}
			return tcp.New("rdma-standin"), nil
		},
		devices: func() []string { return f.devs },
	}
}

// TestOpenPassesLogger: the verbs provider gets the daemon's logger for
// "rdma" and "auto" (its warnings were silenced before).
func TestOpenPassesLogger(t *testing.T) {
	log := zap.NewExample()
	for _, name := range []string{"rdma", "auto"} {
		f := &fakeRDMA{devs: []string{"rxe0"}}
		p, why, err := open(name, log, f.funcs())
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if p.Name() != "rdma-standin" || !strings.Contains(why, "rxe0") {
			t.Errorf("%s: got %s (%s)", name, p.Name(), why)
		}
		if len(f.got) != 1 || f.got[0].Logger != log {
			t.Errorf("%s: the verbs provider was made with %+v, want the logger given", name, f.got)
		}
	}
}

// TestOpenFallsBack: auto takes tcp without devices, or when the verbs
// provider fails, and says why; rdma fails then.
func TestOpenFallsBack(t *testing.T) {
	f := &fakeRDMA{}
	p, why, err := open("auto", nil, f.funcs())
	if err != nil || p.Name() != "tcp" || !strings.Contains(why, "no RDMA device") || len(f.got) != 0 {
		t.Errorf("auto without devices: %v %q %v, made %d", p, why, err, len(f.got))
	}
	f = &fakeRDMA{devs: []string{"rxe0"}, err: transport.ErrUnsupported}
	p, why, err = open("auto", nil, f.funcs())
	if err != nil || p.Name() != "tcp" || !strings.Contains(why, "unusable") {
		t.Errorf("auto with an unusable device: %v %q %v", p, why, err)
	}
	if len(f.got) != 1 || f.got[0].Logger == nil {
		t.Errorf("the verbs provider was made with %+v, want a logger (nop for nil)", f.got)
	}
	if _, _, err := open("rdma", nil, f.funcs()); !errors.Is(err, transport.ErrUnsupported) {
		t.Errorf("rdma with an unusable device: %v", err)
	}
	if _, _, err := open("carrier-pigeon", nil, f.funcs()); err == nil || !strings.Contains(err.Error(), Names) {
		t.Errorf("unknown transport: %v", err)
	}
}

// TestOpenReal: Open over this machine's verbs provider: without a device
// (or without the tag rdma) "rdma" fails saying so, and "auto" is tcp.
func TestOpenReal(t *testing.T) {
	if len(rdma.Devices()) > 0 {
		t.Skipf("devices %v exist", rdma.Devices())
	}
	if _, _, err := Open("rdma", zap.NewNop()); !errors.Is(err, transport.ErrNoDevice) {
		t.Errorf("rdma without devices: %v", err)
	}
	if p, _, err := Open("auto", zap.NewNop()); err != nil || p.Name() != "tcp" {
		t.Errorf("auto without devices: %v, %v", p, err)
	}
}
