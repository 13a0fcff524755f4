package config

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/rblk/rblk/internal/safeopen"
	"github.com/rblk/rblk/target"
)

// ErrInvalid is wrapped by every error about the file's content (an
// *Error, which names the file, line and field).
var ErrInvalid = errors.New("invalid configuration")

// Error is a mistake in the file: where it is and what is wrong.
type Error struct {
	File  string // the file's path as given
	Line  int    // 1-based; 0 when the mistake has no line (an empty file)
	Field string // the setting, such as "exports[1].size"; may be empty
	Msg   string
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	if e.Field != "" {
		b.WriteString(": " + e.Field)
	}
	b.WriteString(": " + e.Msg)
	return b.String()
}

// Unwrap makes errors.Is(err, ErrInvalid) true.
func (e *Error) Unwrap() error { return ErrInvalid }

// Kind is what values a setting takes.
type Kind int

// The kinds of settings.
const (
	String   Kind = iota
	Size          // a byte count with an optional K, M, G or T suffix
	Int           // a non-negative integer
	Duration      // a Go duration: 10s, 4m, 1h30m
	Bool          // true or false
)

// Keys are the settings of the file besides exports, each named like the
// rblkd serve flag it stands for (flag = key with '-' for '_').
var Keys = map[string]Kind{
	"listen":                String,
	"transport":             String,
	"cache_size":            Size,
	"chunk_size":            Size,
	"metrics_listen":        String,
	"auth_file":             String,
	"allow_unauthenticated": Bool,
	"target_id":             String,
	"max_sessions":          Int,
	"max_sessions_per_host": Int,
	"handshake_timeout":     Duration,
	"keepalive_timeout":     Duration,
	"revoke_timeout":        Duration,
	"drain_timeout":         Duration,
	"drain_limit":           Duration,
	"log_format":            String,
	"debug":                 Bool,
	"admin_socket":          String,

	// Limits on connections before authentication and on a session.
	"max_unauthenticated":     Int,
	"max_handles_per_session": Int,
}

// choices are the values some string settings are limited to.
var choices = map[string][]string{
	"transport":  {"tcp", "rdma", "auto"},
	"log_format": {"console", "json"},
}

// FlagName is the rblkd serve flag of a setting.
func FlagName(key string) string { return strings.ReplaceAll(key, "_", "-") }

// Setting is one key: value of the file, other than exports.
type Setting struct {
	Key   string
	Value string // as written (a scalar), checked against the key's Kind
	Line  int
}

// Export is one item of exports:.
type Export struct {
	target.ExportConfig
	Line int // where the item starts
}

// Pool is one item of pools: a directory in which rblkd creates, grows
// and deletes volumes on request (the management API, rblkd export
// create), each a sparse file the pool owns, served as an export.
type Pool struct {
	// Name names the pool in requests: 1-63 bytes of a-z, 0-9 and '-',
	// starting with a letter or digit.
	Name string
	// Directory holds the pool's volumes; an absolute path.
	Directory string
	// Capacity bounds the sum of the sizes of its volumes; 0: the size
	// of the file system the directory is on.
	Capacity int64
	// Labels are the pool's topology (key: value), as CSI's accessible
	// topology: where volumes of this pool can be reached from.
	Labels map[string]string
	Line   int // where the item starts
}

// Management is management: the remote management API (off without it).
type Management struct {
	// Listen is HOST:PORT to serve it on.
	Listen string
	// Cert and Key are rblkd's certificate and key; ClientCA the CA
	// certificates that sign the clients' (PEM files).
	Cert, Key, ClientCA string
	// Clients are who may manage what.
	Clients []ManagementClient
	Line    int
}

// ManagementClient is one of management: clients:.
type ManagementClient struct {
	// Identity is the Common Name of the client's certificate.
	Identity string
	// Pools are the pools it may manage; "*": all.
	Pools []string
}

// Config is a parsed file.
type Config struct {
	// Path is the file's path as given.
	Path string
	// Settings are the settings other than exports, in file order.
	Settings []Setting
	// Exports are the exports, in file order.
	Exports []Export
	// Pools are the storage pools, in file order.
	Pools []Pool
	// Management is the remote management API; nil: off.
	Management *Management

	doc *yaml.Node // the document, for Save
}

// Setting returns the setting key and whether the file has it.
func (c *Config) Setting(key string) (Setting, bool) {
	for _, s := range c.Settings {
		if s.Key == key {
			return s, true
		}
	}
	return Setting{}, false
}

// ExportConfigs returns the exports as the target takes them.
func (c *Config) ExportConfigs() []target.ExportConfig {
	out := make([]target.ExportConfig, len(c.Exports))
	for i, e := range c.Exports {
		out[i] = e.ExportConfig
	}
	return out
}

// MaxFileSize bounds the size of a configuration file.
const MaxFileSize = 16 << 20

// Load reads and parses the file at path. A path that is not a regular
// file (a FIFO, a socket, a device, a directory) is refused at once, never
// waited on (see package safeopen).
func Load(path string) (*Config, error) {
	b, _, err := safeopen.ReadFile(path, MaxFileSize)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	return Parse(path, b)
}

// yamlLine finds the line in the errors of package yaml.
var yamlLine = regexp.MustCompile(`^yaml: (?:unmarshal errors:\n\s*)?line (\d+): (.*)$`)

// Parse parses data, the content of the file path. Unknown keys, keys given
// twice, values of the wrong kind, exports without a name or a path and
// exports named twice are refused with an *Error.
func Parse(path string, data []byte) (*Config, error) {
	c := &Config{Path: path}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
			line, _ := strconv.Atoi(m[1])
			return nil, &Error{File: path, Line: line, Msg: "YAML: " + m[2]}
		}
		return nil, &Error{File: path, Msg: strings.TrimPrefix(err.Error(), "yaml: ")}
	}
	if doc.Kind == 0 || len(doc.Content) == 0 {
		return nil, &Error{File: path, Msg: "empty file: want a mapping of settings with exports:"}
	}
	c.doc = &doc
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, &Error{File: path, Line: root.Line, Msg: "want a mapping of settings (key: value lines)"}
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		if prev, dup := seen[k.Value]; dup {
			return nil, &Error{File: path, Line: k.Line, Field: k.Value, Msg: fmt.Sprintf("given twice (first on line %d)", prev)}
		}
		seen[k.Value] = k.Line
		if k.Value == "exports" {
			exports, err := parseExports(path, v)
			if err != nil {
				return nil, err
			}
			c.Exports = exports
			continue
		}
		if k.Value == "pools" {
			pools, err := parsePools(path, v)
			if err != nil {
				return nil, err
			}
			c.Pools = pools
			continue
		}
		if k.Value == "management" {
			m, err := parseManagement(path, v)
			if err != nil {
				return nil, err
			}
			c.Management = m
			continue
		}
		kind, ok := Keys[k.Value]
		if !ok {
			return nil, &Error{File: path, Line: k.Line, Field: k.Value, Msg: "unknown setting (want one of " + knownKeys() + ")"}
		}
		val, err := scalar(v, kind)
		if err == nil && choices[k.Value] != nil && !slices.Contains(choices[k.Value], val) {
			err = fmt.Errorf("%q: want one of %s", val, strings.Join(choices[k.Value], ", "))
		}
		if err != nil {
			return nil, &Error{File: path, Line: v.Line, Field: k.Value, Msg: err.Error()}
		}
		c.Settings = append(c.Settings, Setting{Key: k.Value, Value: val, Line: v.Line})
	}
	if m := c.Management; m != nil {
		for i, cl := range m.Clients {
			for _, p := range cl.Pools {
				if p != "*" && !slices.ContainsFunc(c.Pools, func(q Pool) bool { return q.Name == p }) {
					return nil, &Error{File: path, Line: m.Line, Field: fmt.Sprintf("management.clients[%d].pools", i),
						Msg: fmt.Sprintf("pool %q is not one of pools:", p)}
				}
			}
		}
		if len(c.Pools) == 0 {
			return nil, &Error{File: path, Line: m.Line, Field: "management", Msg: "the management API manages pools: configure pools: too"}
		}
	}
	return c, nil
}

func knownKeys() string {
	keys := []string{"exports", "pools", "management"}
	for k := range Keys {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return strings.Join(keys, ", ")
}

// scalar checks that n is a scalar of kind and returns its value.
func scalar(n *yaml.Node, kind Kind) (string, error) {
	if n.Kind != yaml.ScalarNode {
		return "", fmt.Errorf("want a single value, not a %s", nodeKind(n))
	}
	v := n.Value
	switch kind {
	case Size:
		if _, err := target.ParseSize(v); err != nil {
			return "", err
		}
	case Int:
		if i, err := strconv.Atoi(v); err != nil || i < 0 {
			return "", fmt.Errorf("%q: want a whole number", v)
		}
	case Duration:
		if d, err := time.ParseDuration(v); err != nil || d < 0 {
			return "", fmt.Errorf("%q: want a duration such as 10s, 4m or 1h30m", v)
		}
	case Bool:
		if v != "true" && v != "false" {
			return "", fmt.Errorf("%q: want true or false", v)
		}
	}
	return v, nil
}

func nodeKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "mapping"
	case yaml.SequenceNode:
		return "list"
	case yaml.AliasNode:
		return "alias"
	}
	return "value"
}

func parseExports(path string, n *yaml.Node) ([]Export, error) {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil, nil // exports: with nothing under it
	}
	if n.Kind != yaml.SequenceNode {
		return nil, &Error{File: path, Line: n.Line, Field: "exports", Msg: "want a list of exports (lines starting with \"- name: \")"}
	}
	var out []Export
	names := map[string]int{}
	for i, item := range n.Content {
		field := fmt.Sprintf("exports[%d]", i)
		e, err := parseExport(path, field, item)
		if err != nil {
			return nil, err
		}
		if prev, dup := names[e.Name]; dup {
			return nil, &Error{File: path, Line: item.Line, Field: field + ".name", Msg: fmt.Sprintf("export %q given twice (first on line %d)", e.Name, prev)}
		}
		names[e.Name] = item.Line
		out = append(out, e)
	}
	return out, nil
}

func parseExport(path, field string, n *yaml.Node) (Export, error) {
	e := Export{Line: n.Line}
	bad := func(line int, key, msg string) (Export, error) {
		f := field
		if key != "" {
			f += "." + key
		}
		return Export{}, &Error{File: path, Line: line, Field: f, Msg: msg}
	}
	if n.Kind != yaml.MappingNode {
		return bad(n.Line, "", "want a mapping with name:, path: and the export's options")
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if seen[k.Value] {
			return bad(k.Line, k.Value, "given twice")
		}
		seen[k.Value] = true
		var err error
		var val string
		switch k.Value {
		case "name", "path":
			if val, err = scalar(v, String); err == nil && val == "" {
				err = errors.New("empty")
			}
			if k.Value == "name" {
				e.Name = val
				if err == nil && (len(val) > 255 || strings.ContainsAny(val, "\x00/")) {
					err = fmt.Errorf("%q: want 1-255 bytes without '/'", val)
				}
			} else {
				e.Path = val
			}
		case "size":
			if val, err = scalar(v, Size); err == nil {
				e.Size, _ = target.ParseSize(val)
				if e.Size <= 0 {
					err = fmt.Errorf("%q: want a size above 0", val)
				}
			}
		case "read_only", "shared", "private":
			if val, err = scalar(v, Bool); err == nil {
				switch k.Value {
				case "read_only":
					e.ReadOnly = val == "true"
				case "shared":
					e.Shared = val == "true"
				default:
					e.Private = val == "true"
				}
			}
		case "allow":
			e.Allow, err = hostList(v)
		default:
			return bad(k.Line, k.Value, "unknown export option (want name, path, size, read_only, shared, private or allow)")
		}
		if err != nil {
			return bad(v.Line, k.Value, err.Error())
		}
	}
	switch {
	case e.Name == "":
		return bad(n.Line, "name", "missing: every export needs a name")
	case e.Path == "":
		return bad(n.Line, "path", "missing: every export needs a path (a file or a block device)")
	}
	return e, nil
}

// poolName is what a pool's name may be: a DNS label (no '.', no ':', no
// '/': it is part of its volumes' export names, "POOL:VOLUME").
var poolName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// ValidPoolName reports whether name may name a pool.
func ValidPoolName(name string) bool { return poolName.MatchString(name) }

func parsePools(path string, n *yaml.Node) ([]Pool, error) {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil, nil
	}
	if n.Kind != yaml.SequenceNode {
		return nil, &Error{File: path, Line: n.Line, Field: "pools", Msg: "want a list of pools (lines starting with \"- name: \")"}
	}
	var out []Pool
	names, dirs := map[string]int{}, map[string]int{}
	for i, item := range n.Content {
		field := fmt.Sprintf("pools[%d]", i)
		p, err := parsePool(path, field, item)
		if err != nil {
			return nil, err
		}
		if prev, dup := names[p.Name]; dup {
			return nil, &Error{File: path, Line: item.Line, Field: field + ".name", Msg: fmt.Sprintf("pool %q given twice (first on line %d)", p.Name, prev)}
		}
		if prev, dup := dirs[p.Directory]; dup {
			return nil, &Error{File: path, Line: item.Line, Field: field + ".directory",
				Msg: fmt.Sprintf("%s is the directory of another pool too (line %d): a directory holds one pool", p.Directory, prev)}
		}
		names[p.Name], dirs[p.Directory] = item.Line, item.Line
		out = append(out, p)
	}
	return out, nil
}

func parsePool(path, field string, n *yaml.Node) (Pool, error) {
	p := Pool{Line: n.Line}
	bad := func(line int, key, msg string) (Pool, error) {
		f := field
		if key != "" {
			f += "." + key
		}
		return Pool{}, &Error{File: path, Line: line, Field: f, Msg: msg}
	}
	if n.Kind != yaml.MappingNode {
		return bad(n.Line, "", "want a mapping with name:, directory: and the pool's options")
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if seen[k.Value] {
			return bad(k.Line, k.Value, "given twice")
		}
		seen[k.Value] = true
		var err error
		var val string
		switch k.Value {
		case "name":
			if val, err = scalar(v, String); err == nil && !ValidPoolName(val) {
				err = fmt.Errorf("%q: want 1-63 of a-z, 0-9 and '-', starting and ending with a letter or digit", val)
			}
			p.Name = val
		case "directory":
			if val, err = scalar(v, String); err == nil {
				switch {
				case !filepath.IsAbs(val):
					err = fmt.Errorf("%q: want an absolute path", val)
				case filepath.Clean(val) == "/":
					err = errors.New("\"/\": want a directory of its own")
				}
			}
			p.Directory = filepath.Clean(val)
		case "capacity":
			if val, err = scalar(v, Size); err == nil {
				p.Capacity, _ = target.ParseSize(val)
				if p.Capacity <= 0 {
					err = fmt.Errorf("%q: want a size above 0", val)
				}
			}
		case "labels":
			p.Labels, err = labels(v)
		default:
			return bad(k.Line, k.Value, "unknown pool option (want name, directory, capacity or labels)")
		}
		if err != nil {
			return bad(v.Line, k.Value, err.Error())
		}
	}
	switch {
	case p.Name == "":
		return bad(n.Line, "name", "missing: every pool needs a name")
	case p.Directory == "":
		return bad(n.Line, "directory", "missing: every pool needs a directory")
	}
	return p, nil
}

func parseManagement(path string, n *yaml.Node) (*Management, error) {
	m := &Management{Line: n.Line}
	bad := func(line int, key, msg string) (*Management, error) {
		f := "management"
		if key != "" {
			f += "." + key
		}
		return nil, &Error{File: path, Line: line, Field: f, Msg: msg}
	}
	if n.Kind != yaml.MappingNode {
		return bad(n.Line, "", "want a mapping with listen:, cert:, key:, client_ca: and clients:")
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if seen[k.Value] {
			return bad(k.Line, k.Value, "given twice")
		}
		seen[k.Value] = true
		var err error
		var val string
		switch k.Value {
		case "listen", "cert", "key", "client_ca":
			if val, err = scalar(v, String); err == nil && val == "" {
				err = errors.New("empty")
			}
			switch k.Value {
			case "listen":
				m.Listen = val
			case "cert":
				m.Cert = val
			case "key":
				m.Key = val
			default:
				m.ClientCA = val
			}
		case "clients":
			m.Clients, err = managementClients(v)
		default:
			return bad(k.Line, k.Value, "unknown management option (want listen, cert, key, client_ca or clients)")
		}
		if err != nil {
			return bad(v.Line, k.Value, err.Error())
		}
	}
	for _, k := range []string{"listen", "cert", "key", "client_ca", "clients"} {
		if !seen[k] {
			return bad(n.Line, k, "missing: the management API needs listen, cert, key, client_ca and clients")
		}
	}
	return m, nil
}

// managementClients is management: clients:: a list of identity: and
// pools:.
func managementClients(n *yaml.Node) ([]ManagementClient, error) {
	if n.Kind != yaml.SequenceNode || len(n.Content) == 0 {
		return nil, errors.New("want a list of clients, such as [{identity: rblk-csi-controller, pools: [\"*\"]}]")
	}
	var out []ManagementClient
	ids := map[string]bool{}
	for _, item := range n.Content {
		if item.Kind != yaml.MappingNode {
			return nil, fmt.Errorf("line %d: want a mapping of identity and pools", item.Line)
		}
		var c ManagementClient
		for i := 0; i+1 < len(item.Content); i += 2 {
			k, v := item.Content[i], item.Content[i+1]
			switch k.Value {
			case "identity":
				if v.Kind != yaml.ScalarNode || v.Value == "" || len(v.Value) > 255 {
					return nil, fmt.Errorf("line %d: identity: want the Common Name of the client's certificate", v.Line)
				}
				c.Identity = v.Value
			case "pools":
				if v.Kind != yaml.SequenceNode || len(v.Content) == 0 {
					return nil, fmt.Errorf("line %d: pools: want a list of pool names, or [\"*\"] for all", v.Line)
				}
				for _, p := range v.Content {
					if p.Kind != yaml.ScalarNode || (p.Value != "*" && !ValidPoolName(p.Value)) {
						return nil, fmt.Errorf("line %d: pools: %q is no pool name", p.Line, p.Value)
					}
					c.Pools = append(c.Pools, p.Value)
				}
			default:
				return nil, fmt.Errorf("line %d: %s: unknown client option (want identity or pools)", k.Line, k.Value)
			}
		}
		if c.Identity == "" || len(c.Pools) == 0 {
			return nil, fmt.Errorf("line %d: a client needs an identity and pools", item.Line)
		}
		if ids[c.Identity] {
			return nil, fmt.Errorf("line %d: client %q given twice", item.Line, c.Identity)
		}
		ids[c.Identity] = true
		out = append(out, c)
	}
	return out, nil
}

// labelKey is a topology key as Kubernetes takes it: an optional DNS
// prefix and a name.
var labelKey = regexp.MustCompile(`^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$`)

// labelValue is a label value as Kubernetes takes it.
var labelValue = regexp.MustCompile(`^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$`)

// labels is a pool's labels: a mapping of label keys to values.
func labels(n *yaml.Node) (map[string]string, error) {
	if n.Kind != yaml.MappingNode {
		return nil, errors.New("want a mapping of labels, such as {topology.rblk.io/zone: a}")
	}
	out := map[string]string{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind != yaml.ScalarNode || v.Kind != yaml.ScalarNode {
			return nil, fmt.Errorf("line %d: want key: value", k.Line)
		}
		if len(k.Value) > 316 || !labelKey.MatchString(k.Value) {
			return nil, fmt.Errorf("line %d: %q: want a label key such as topology.rblk.io/zone", k.Line, k.Value)
		}
		if !labelValue.MatchString(v.Value) {
			return nil, fmt.Errorf("line %d: %q: want a label value of at most 63 letters, digits, '-', '_' and '.'", v.Line, v.Value)
		}
		if _, dup := out[k.Value]; dup {
			return nil, fmt.Errorf("line %d: label %q given twice", k.Line, k.Value)
		}
		out[k.Value] = v.Value
	}
	return out, nil
}

// hostList is allow: a list of host IDs.
func hostList(n *yaml.Node) ([]string, error) {
	if n.Kind != yaml.SequenceNode {
		return nil, errors.New("want a list of host IDs, such as [host-a, host-b]")
	}
	var out []string
	for _, h := range n.Content {
		if h.Kind != yaml.ScalarNode || h.Value == "" || len(h.Value) > 255 || strings.ContainsRune(h.Value, 0) {
			return nil, fmt.Errorf("line %d: want a host ID of 1-255 bytes", h.Line)
		}
		out = append(out, h.Value)
	}
	return out, nil
}

// FormatSize writes a byte count with the largest suffix that divides it.
func FormatSize(n int64) string {
	for _, u := range []struct {
		s string
		m int64
	}{{"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}} {
		if n >= u.m && n%u.m == 0 {
			return strconv.FormatInt(n/u.m, 10) + u.s
		}
	}
	return strconv.FormatInt(n, 10)
}

// exportsNode returns the sequence of exports, creating an empty one
// (exports: []) if the file has none.
func (c *Config) exportsNode() *yaml.Node {
	root := c.doc.Content[0]
	for i := 0; i+1 < len(root.Content); i += 2 {
		if root.Content[i].Value == "exports" {
			v := root.Content[i+1]
			if v.Kind != yaml.SequenceNode {
				*v = yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
			}
			return v
		}
	}
	v := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
	root.Content = append(root.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: "exports"}, v)
	return v
}

func str(v string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: v} }

// exportNode is e as a mapping, with only the options it sets.
func exportNode(e target.ExportConfig) *yaml.Node {
	m := &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
	add := func(k string, v *yaml.Node) { m.Content = append(m.Content, str(k), v) }
	add("name", str(e.Name))
	add("path", str(e.Path))
	if e.Size > 0 {
		add("size", str(FormatSize(e.Size)))
	}
	if e.ReadOnly {
		add("read_only", &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: "true"})
	}
	if e.Shared {
		add("shared", &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: "true"})
	}
	if e.Private {
		add("private", &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!bool", Value: "true"})
	}
	if len(e.Allow) > 0 {
		l := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq", Style: yaml.FlowStyle}
		for _, h := range e.Allow {
			l.Content = append(l.Content, str(h))
		}
		add("allow", l)
	}
	return m
}

// findExport returns the index of export name in the sequence, -1 if none.
func findExport(seq *yaml.Node, name string) int {
	for i, item := range seq.Content {
		if item.Kind != yaml.MappingNode {
			continue
		}
		for j := 0; j+1 < len(item.Content); j += 2 {
			if item.Content[j].Value == "name" && item.Content[j+1].Value == name {
				return i
			}
		}
	}
	return -1
}

// AddExport adds e at the end of exports (Save writes it). An export of
// that name already there is replaced in place, keeping its comments.
func (c *Config) AddExport(e target.ExportConfig) {
	seq := c.exportsNode()
	n := exportNode(e)
	if i := findExport(seq, e.Name); i >= 0 {
		n.HeadComment, n.LineComment, n.FootComment = seq.Content[i].HeadComment, seq.Content[i].LineComment, seq.Content[i].FootComment
		seq.Content[i] = n
	} else {
		seq.Style = 0 // block style, even if it was "exports: []"
		seq.Content = append(seq.Content, n)
	}
	c.setExport(e)
}

func (c *Config) setExport(e target.ExportConfig) {
	for i := range c.Exports {
		if c.Exports[i].Name == e.Name {
			c.Exports[i].ExportConfig = e
			return
		}
	}
	c.Exports = append(c.Exports, Export{ExportConfig: e})
}

// RemoveExport takes export name out of exports; it reports whether it was
// there.
func (c *Config) RemoveExport(name string) bool {
	seq := c.exportsNode()
	i := findExport(seq, name)
	if i < 0 {
		return false
	}
	seq.Content = slices.Delete(seq.Content, i, i+1)
	c.Exports = slices.DeleteFunc(c.Exports, func(e Export) bool { return e.Name == name })
	return true
}

// SetExportSize sets the size of export name (its other lines and comments
// stay); it reports whether the export is in the file.
func (c *Config) SetExportSize(name string, size int64) bool {
	seq := c.exportsNode()
	i := findExport(seq, name)
	if i < 0 {
		return false
	}
	item := seq.Content[i]
	for j := 0; j+1 < len(item.Content); j += 2 {
		if item.Content[j].Value == "size" {
			item.Content[j+1].Value = FormatSize(size)
			item.Content[j+1].Tag = "!!str"
			item.Content[j+1].Style = 0
			c.setSize(name, size)
			return true
		}
	}
	item.Content = append(item.Content, str("size"), str(FormatSize(size)))
	c.setSize(name, size)
	return true
}

func (c *Config) setSize(name string, size int64) {
	for i := range c.Exports {
		if c.Exports[i].Name == name {
			c.Exports[i].Size = size
		}
	}
}

// Marshal is the file's content with the changes made (comments and the
// order of keys kept).
func (c *Config) Marshal() ([]byte, error) {
	var b bytes.Buffer
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(c.doc); err != nil {
		return nil, fmt.Errorf("encode %s: %w", c.Path, err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encode %s: %w", c.Path, err)
	}
	return b.Bytes(), nil
}

// Save writes the file back atomically: Stage, then Commit.
func (c *Config) Save() error {
	st, err := c.Stage()
	if err != nil {
		return err
	}
	return st.Commit()
}

// Staged is the file's new content written beside it and synced, not yet
// in place: a caller stages the file before it makes the change the file
// records, then commits (or aborts) once the change is made (or refused).
type Staged struct {
	path, tmp string // the file (symbolic links resolved) and the temporary one
	done      bool
}

// Stage writes the content with the changes made to a temporary file
// beside the file (of the file's mode) and syncs it. If the file is a
// symbolic link, the file it points to is the one written: the link
// stays.
func (c *Config) Stage() (*Staged, error) {
	b, err := c.Marshal()
	if err != nil {
		return nil, err
	}
	path := c.Path
	if p, err := filepath.EvalSymlinks(c.Path); err == nil {
		path = p
	}
	mode := os.FileMode(0o644)
	if st, err := os.Stat(path); err == nil {
		mode = st.Mode().Perm()
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return nil, fmt.Errorf("save %s: %w", c.Path, err)
	}
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Chmod(mode)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp.Name())
		return nil, fmt.Errorf("save %s: %w", c.Path, err)
	}
	return &Staged{path: path, tmp: tmp.Name()}, nil
}

// Commit renames the staged file over the file and syncs the directory.
func (s *Staged) Commit() error {
	if s.done {
		return errors.New("save: committed or aborted already")
	}
	s.done = true
	if err := os.Rename(s.tmp, s.path); err != nil {
		os.Remove(s.tmp)
		return fmt.Errorf("save %s: %w", s.path, err)
	}
	if d, err := os.Open(filepath.Dir(s.path)); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// Abort removes the staged file; the file is left as it was. Safe after
// Commit (then it does nothing).
func (s *Staged) Abort() {
	if s == nil || s.done {
		return
	}
	s.done = true
	os.Remove(s.tmp)
}
