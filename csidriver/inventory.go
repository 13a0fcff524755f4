package csidriver

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"regexp"
	"sort"

	"google.golang.org/grpc"
	"gopkg.in/yaml.v3"

	"github.com/rblk/rblk/internal/safeopen"
	"github.com/rblk/rblk/manage/managepb"
	"github.com/rblk/rblk/manage/remote"
)

// TargetConfig is a target of the inventory.
type TargetConfig struct {
	// Name names the target in volume IDs: 1-63 of a-z, 0-9 and '-'.
	Name string `yaml:"name"`
	// Management is its management API, HOST:PORT.
	Management string `yaml:"management"`
	// Address is where initiators reach it (rblk-attach --target).
	Address string `yaml:"address"`
	// Transport is rblk-attach's --transport for it: rdma, tcp or auto
	// (default auto).
	Transport string `yaml:"transport"`
	// ServerName is the name its certificate carries (default: the host
	// of Management).
	ServerName string `yaml:"server_name"`
}

// InventoryFile is the controller's inventory file.
type InventoryFile struct {
	Targets []TargetConfig `yaml:"targets"`
}

var targetName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// LoadInventory reads an inventory file (YAML).
func LoadInventory(path string) (*InventoryFile, error) {
	b, _, err := safeopen.ReadFile(path, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("inventory: %w", err)
	}
	var f InventoryFile
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("inventory %s: %w", path, err)
	}
	if err := f.check(); err != nil {
		return nil, fmt.Errorf("inventory %s: %w", path, err)
	}
	return &f, nil
}

func (f *InventoryFile) check() error {
	if len(f.Targets) == 0 {
		return errors.New("no targets")
	}
	seen := map[string]bool{}
	for i, t := range f.Targets {
		switch {
		case !targetName.MatchString(t.Name):
			return fmt.Errorf("targets[%d]: name %q: want 1-63 of a-z, 0-9 and '-'", i, t.Name)
		case seen[t.Name]:
			return fmt.Errorf("targets[%d]: target %q given twice", i, t.Name)
		case t.Management == "" || t.Address == "":
			return fmt.Errorf("targets[%d] (%s): management: and address: are required", i, t.Name)
		}
		if _, _, err := net.SplitHostPort(t.Management); err != nil {
			return fmt.Errorf("targets[%d] (%s): management: %w", i, t.Name, err)
		}
		switch t.Transport {
		case "", "auto", "rdma", "tcp":
		default:
			return fmt.Errorf("targets[%d] (%s): transport %q: want rdma, tcp or auto", i, t.Name, t.Transport)
		}
		seen[t.Name] = true
	}
	return nil
}

// target is a target of the inventory and its API client.
type target struct {
	TargetConfig
	api managepb.ManageClient
	cc  *grpc.ClientConn
}

// Inventory is the targets the controller provisions on.
type Inventory struct {
	targets map[string]*target
	names   []string
}

// NewInventory dials (lazily) the management API of every target of f
// with the client TLS configuration tc.
func NewInventory(f *InventoryFile, tc *tls.Config) (*Inventory, error) {
	if err := f.check(); err != nil {
		return nil, err
	}
	inv := &Inventory{targets: map[string]*target{}}
	for _, t := range f.Targets {
		c := tc.Clone()
		if t.ServerName != "" {
			c.ServerName = t.ServerName
		} else if host, _, err := net.SplitHostPort(t.Management); err == nil {
			c.ServerName = host
		}
		api, cc, err := remote.Dial(t.Management, c)
		if err != nil {
			inv.Close()
			return nil, err
		}
		if t.Transport == "" {
			t.Transport = "auto"
		}
		inv.targets[t.Name] = &target{TargetConfig: t, api: api, cc: cc}
		inv.names = append(inv.names, t.Name)
	}
	sort.Strings(inv.names)
	return inv, nil
}

// Close closes the API connections.
func (inv *Inventory) Close() {
	for _, t := range inv.targets {
		t.cc.Close()
	}
}
