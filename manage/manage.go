package manage

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"

	"go.uber.org/zap"

	"github.com/rblk/rblk/pool"
	"github.com/rblk/rblk/target"
)

// ErrNoPool: a request names a pool rblkd does not have.
var ErrNoPool = errors.New("no such pool")

// ErrInvalid is pool.ErrInvalid: a bad name, size or host ID.
var ErrInvalid = pool.ErrInvalid

// ErrUnknownHost: Publish to a host that cannot exist (Options.KnownHost
// refuses it: rblkd has no key for it).
var ErrUnknownHost = errors.New("unknown host")

// Options configure a Service.
type Options struct {
	// Logger: what was done, and volumes not served. Default: none.
	Logger *zap.Logger
	// KnownHost, if set, says whether a host ID can open volumes (rblkd
	// has its key): Publish to another is ErrUnknownHost. Nil: any host.
	KnownHost func(host string) bool
}

// Target is what the Service needs of the target (a *target.Target).
type Target interface {
	PrepareExport(ctx context.Context, e target.ExportConfig) (*target.PreparedExport, error)
	AddPrepared(ctx context.Context, p *target.PreparedExport) error
	RemoveExport(ctx context.Context, name string) error
	UpdateExport(ctx context.Context, e target.ExportConfig) error
	FenceHost(ctx context.Context, name, host string) (int, error)
	Grow(ctx context.Context, name string, size int64) error
	Exports() []target.ExportStatus
}

// Service manages the volumes of rblkd's pools.
type Service struct {
	t     Target
	pools map[string]*pool.Pool
	log   *zap.Logger
	known func(host string) bool

	// locks serializes the operations on one volume (by export name);
	// operations on other volumes go on meanwhile.
	locksMu sync.Mutex
	locks   map[string]chan struct{}
}

// New serves every volume of pools on t (a damaged one, or one the target
// cannot open, is logged and left out) and returns the Service that
// manages them.
func New(ctx context.Context, t Target, pools []*pool.Pool, opts Options) (*Service, error) {
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	s := &Service{t: t, pools: map[string]*pool.Pool{}, log: log, known: opts.KnownHost, locks: map[string]chan struct{}{}}
	for _, p := range pools {
		s.pools[p.Name()] = p
	}
	for _, p := range pools {
		vols, err := p.List()
		if err != nil {
			return nil, err
		}
		for _, v := range vols {
			// One volume that cannot be served keeps neither rblkd nor
			// the others down: it is logged, and a Create of it (the
			// same name, size and sharing) tries again.
			if err := s.serve(ctx, v); err != nil {
				log.Error("volume not served", zap.String("pool", p.Name()), zap.String("volume", v.Name), zap.Error(err))
			}
		}
		for name, err := range p.Damaged() {
			log.Error("volume not served: damaged", zap.String("pool", p.Name()), zap.String("volume", name), zap.Error(err))
		}
	}
	return s, nil
}

// exportConfig is how v is served.
func exportConfig(v pool.Volume) target.ExportConfig {
	return target.ExportConfig{Name: v.Export(), Path: v.Path, Private: true, Shared: v.Shared, Allow: slices.Clone(v.Hosts)}
}

// serve adds v as an export, after checking that the file the target
// opened is the volume's (its inode).
func (s *Service) serve(ctx context.Context, v pool.Volume) error {
	pe, err := s.t.PrepareExport(ctx, exportConfig(v))
	if err != nil {
		return fmt.Errorf("serve volume %q: %w", v.Name, err)
	}
	if id := pe.File(); id.Ino != v.Ino {
		pe.Discard()
		return fmt.Errorf("serve volume %q: %s is inode %d, the pool's record says %d: %w", v.Name, v.Path, id.Ino, v.Ino, pool.ErrDamaged)
	}
	if err := s.t.AddPrepared(ctx, pe); err != nil {
		return fmt.Errorf("serve volume %q: %w", v.Name, err)
	}
	return nil
}

// Owns reports whether export is a pool volume's name: POOL:VOLUME of a
// pool rblkd has.
func (s *Service) Owns(export string) bool {
	p, _, ok := strings.Cut(export, ":")
	return ok && s.pools[p] != nil
}

// lock takes the lock of volume export, or fails when ctx ends first.
func (s *Service) lock(ctx context.Context, export string) (unlock func(), err error) {
	for {
		s.locksMu.Lock()
		ch, busy := s.locks[export]
		if !busy {
			ch = make(chan struct{})
			s.locks[export] = ch
			s.locksMu.Unlock()
			return func() {
				s.locksMu.Lock()
				delete(s.locks, export)
				s.locksMu.Unlock()
				close(ch)
			}, nil
		}
		s.locksMu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for another operation on volume %q: %w", export, ctx.Err())
		}
	}
}

// begin finds the pool, checks the volume's name and takes its lock.
func (s *Service) begin(ctx context.Context, poolName, name string) (*pool.Pool, func(), error) {
	p := s.pools[poolName]
	if p == nil {
		return nil, nil, fmt.Errorf("pool %q: %w (have: %s)", poolName, ErrNoPool, strings.Join(s.poolNames(), ", "))
	}
	if err := pool.CheckName(name); err != nil {
		return nil, nil, err
	}
	unlock, err := s.lock(ctx, pool.ExportName(poolName, name))
	if err != nil {
		return nil, nil, err
	}
	return p, unlock, nil
}

func (s *Service) poolNames() []string {
	out := make([]string, 0, len(s.pools))
	for n := range s.pools {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Volume is a volume as the Service reports it.
type Volume struct {
	pool.Volume
	// Export is the name initiators open it by.
	Export string
	// Sessions and Writers: the sessions that have it open now, and of
	// those the read-write ones.
	Sessions, Writers int
	// Labels are its pool's topology.
	Labels map[string]string
}

func (s *Service) report(p *pool.Pool, v pool.Volume) Volume {
	out := Volume{Volume: v, Export: v.Export(), Labels: p.Labels()}
	for _, st := range s.t.Exports() {
		if st.Config.Name == out.Export {
			out.Sessions, out.Writers = st.Sessions, st.Writers
		}
	}
	return out
}

// Create creates volume name of size bytes in pool poolName and serves
// it, published to no host. A volume of that name, size and sharing is
// returned as it is (created false).
func (s *Service) Create(ctx context.Context, poolName, name string, size int64, shared bool) (v Volume, created bool, err error) {
	p, unlock, err := s.begin(ctx, poolName, name)
	if err != nil {
		return Volume{}, false, fmt.Errorf("create volume: %w", err)
	}
	defer unlock()
	pv, created, err := p.Create(name, size, shared)
	if err != nil {
		return Volume{}, false, err
	}
	if !s.served(pv.Export()) {
		if err := s.serve(ctx, pv); err != nil {
			if created {
				if derr := p.Delete(name); derr != nil {
					s.log.Error("delete a volume that could not be served", zap.String("pool", poolName), zap.String("volume", name), zap.Error(derr))
				}
			}
			return Volume{}, false, fmt.Errorf("create volume %q in pool %q: %w", name, poolName, err)
		}
	}
	return s.report(p, pv), created, nil
}

// served reports whether the target serves export.
func (s *Service) served(export string) bool {
	for _, st := range s.t.Exports() {
		if st.Config.Name == export {
			return true
		}
	}
	return false
}

// Delete stops serving volume name of pool poolName (its sessions
// drained, its data written back) and deletes it. pool.ErrNotFound if
// there is none.
func (s *Service) Delete(ctx context.Context, poolName, name string) error {
	p, unlock, err := s.begin(ctx, poolName, name)
	if err != nil {
		return fmt.Errorf("delete volume: %w", err)
	}
	defer unlock()
	v, err := p.Get(name)
	if err != nil {
		return err
	}
	if s.served(v.Export()) {
		if err := s.t.RemoveExport(ctx, v.Export()); err != nil {
			return fmt.Errorf("delete volume %q of pool %q: %w", name, poolName, err)
		}
	}
	return p.Delete(name)
}

// Expand grows volume name of pool poolName to size bytes online (its
// initiators learn the new size); a size it has already is no change.
// It returns the volume.
func (s *Service) Expand(ctx context.Context, poolName, name string, size int64) (Volume, error) {
	p, unlock, err := s.begin(ctx, poolName, name)
	if err != nil {
		return Volume{}, fmt.Errorf("expand volume: %w", err)
	}
	defer unlock()
	v, err := p.Get(name)
	if err != nil {
		return Volume{}, err
	}
	if size == v.Size {
		return s.report(p, v), nil
	}
	release, err := p.ReserveGrow(name, size)
	if err != nil {
		return Volume{}, err
	}
	defer release()
	if err := s.t.Grow(ctx, v.Export(), size); err != nil {
		return Volume{}, fmt.Errorf("expand volume %q of pool %q: %w", name, poolName, err)
	}
	if v, err = p.Get(name); err != nil {
		return Volume{}, err
	}
	return s.report(p, v), nil
}

// checkHost says why host cannot be a host ID, or nil.
func checkHost(host string) error {
	if host == "" || len(host) > 255 || strings.ContainsRune(host, 0) {
		return fmt.Errorf("host ID %q: want 1-255 bytes without NUL: %w", host, ErrInvalid)
	}
	return nil
}

// Publish lets host open volume name of pool poolName (recorded first,
// then applied). Publishing a host twice is no change. A host that cannot
// exist (Options.KnownHost) is ErrUnknownHost.
func (s *Service) Publish(ctx context.Context, poolName, name, host string) (Volume, error) {
	if err := checkHost(host); err != nil {
		return Volume{}, fmt.Errorf("publish volume %q: %w", name, err)
	}
	if s.known != nil && !s.known(host) {
		return Volume{}, fmt.Errorf("publish volume %q to host %q: rblkd has no key for it (its --auth-file): %w", name, host, ErrUnknownHost)
	}
	p, unlock, err := s.begin(ctx, poolName, name)
	if err != nil {
		return Volume{}, fmt.Errorf("publish volume: %w", err)
	}
	defer unlock()
	v, err := p.Get(name)
	if err != nil {
		return Volume{}, err
	}
	if !slices.Contains(v.Hosts, host) {
		if err := p.SetHosts(name, append(v.Hosts, host)); err != nil {
			return Volume{}, err
		}
		if v, err = p.Get(name); err != nil {
			return Volume{}, err
		}
	}
	if err := s.t.UpdateExport(ctx, exportConfig(v)); err != nil {
		return Volume{}, fmt.Errorf("publish volume %q of pool %q to host %q: %w", name, poolName, host, err)
	}
	s.log.Info("volume published", zap.String("pool", poolName), zap.String("volume", name), zap.String("host_id", host))
	return s.report(p, v), nil
}

// Unpublish takes host off volume name of pool poolName: recorded first,
// then the host is fenced (its sessions of the volume closed, their keys
// dead, nothing they still send lands) before Unpublish returns. A host
// not published is fenced all the same, and that is no error. It returns
// how many sessions were fenced.
func (s *Service) Unpublish(ctx context.Context, poolName, name, host string) (int, error) {
	if err := checkHost(host); err != nil {
		return 0, fmt.Errorf("unpublish volume %q: %w", name, err)
	}
	p, unlock, err := s.begin(ctx, poolName, name)
	if err != nil {
		return 0, fmt.Errorf("unpublish volume: %w", err)
	}
	defer unlock()
	v, err := p.Get(name)
	if err != nil {
		return 0, err
	}
	if err := p.SetHosts(name, slices.DeleteFunc(slices.Clone(v.Hosts), func(h string) bool { return h == host })); err != nil {
		return 0, err
	}
	n, err := s.t.FenceHost(ctx, v.Export(), host)
	if err != nil {
		return n, fmt.Errorf("unpublish volume %q of pool %q from host %q: %w", name, poolName, host, err)
	}
	s.log.Info("volume unpublished", zap.String("pool", poolName), zap.String("volume", name), zap.String("host_id", host), zap.Int("sessions_fenced", n))
	return n, nil
}

// Get returns volume name of pool poolName.
func (s *Service) Get(poolName, name string) (Volume, error) {
	p := s.pools[poolName]
	if p == nil {
		return Volume{}, fmt.Errorf("pool %q: %w", poolName, ErrNoPool)
	}
	v, err := p.Get(name)
	if err != nil {
		return Volume{}, err
	}
	return s.report(p, v), nil
}

// List returns the volumes of pool poolName, or of every pool if it is
// "", by pool and name.
func (s *Service) List(poolName string) ([]Volume, error) {
	names := s.poolNames()
	if poolName != "" {
		if s.pools[poolName] == nil {
			return nil, fmt.Errorf("pool %q: %w", poolName, ErrNoPool)
		}
		names = []string{poolName}
	}
	var out []Volume
	for _, n := range names {
		p := s.pools[n]
		vols, err := p.List()
		if err != nil {
			return nil, err
		}
		for _, v := range vols {
			out = append(out, s.report(p, v))
		}
	}
	return out, nil
}

// PoolStatus is a pool and its capacity.
type PoolStatus struct {
	Name   string
	Labels map[string]string
	pool.Capacity
	// Damaged counts its volumes not served.
	Damaged int
}

// Pools returns every pool's status, by name (or only poolName's).
func (s *Service) Pools(poolName string) ([]PoolStatus, error) {
	names := s.poolNames()
	if poolName != "" {
		if s.pools[poolName] == nil {
			return nil, fmt.Errorf("pool %q: %w", poolName, ErrNoPool)
		}
		names = []string{poolName}
	}
	out := make([]PoolStatus, 0, len(names))
	for _, n := range names {
		p := s.pools[n]
		c, err := p.Capacity()
		if err != nil {
			return nil, err
		}
		out = append(out, PoolStatus{Name: n, Labels: p.Labels(), Capacity: c, Damaged: len(p.Damaged())})
	}
	return out, nil
}
