// Command rdmaread measures the raw round trip of one-sided RDMA between two
// processes over one of rblk's transport providers: the floor under rblk's
// data path, with no grant, no NBD and no volume in the way.
//
//	rdmaread serve [-listen 127.0.0.1:0] [-transport tcp] [-size 64M]
//	rdmaread run -target ADDR [-transport tcp] [-time 3s] [-jobs read:4096:1,read:4096:32]
//
// serve registers -size bytes for remote read and write, prints
// "listening ADDR" on stdout once it accepts connections, and serves
// until SIGINT or SIGTERM (each client gets the region's address and rkey
// in the accept's private data). run connects and, for each job
// OP:BLOCKSIZE:DEPTH (OP read or write), keeps DEPTH requests of BLOCKSIZE
// bytes in flight for -time, at spread offsets of the region, and prints
// one JSON object a job: ios, seconds, iops, MB/s and the latency of each
// request from its post to its completion (mean, p50, p99, in µs). A
// connection that can deliver completions itself (transport's
// CompletionHandler) is measured that way as well ("mode": "handler"),
// beside Poll ("mode": "poll").
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/providers"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "run":
		err = run(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "rdmaread:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: rdmaread serve [-listen ADDR] [-transport tcp|rdma] [-size BYTES]\n"+
		"       rdmaread run -target ADDR [-transport tcp|rdma] [-time 3s] [-jobs read:4096:1,read:4096:32]")
	os.Exit(2)
}

const allAccess = transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite

// parseSize reads BYTES with an optional K, M or G suffix (powers of 1024).
func parseSize(s string) (int, error) {
	mult := 1
	switch {
	case strings.HasSuffix(s, "K"):
		mult = 1 << 10
	case strings.HasSuffix(s, "M"):
		mult = 1 << 20
	case strings.HasSuffix(s, "G"):
		mult = 1 << 30
	}
	n, err := strconv.Atoi(strings.TrimRight(s, "KMG"))
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("size %q: want BYTES[K|M|G]", s)
	}
	return n * mult, nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "address to listen on")
	tname := fs.String("transport", "tcp", "transport provider: "+providers.Names)
	sizeS := fs.String("size", "64M", "bytes of registered memory the clients read and write")
	fs.Parse(args)
	size, err := parseSize(*sizeS)
	if err != nil {
		return err
	}
	p, _, err := providers.Open(*tname, zap.NewNop())
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	mem, err := transport.AllocMemory(size, false)
	if err != nil {
		return err
	}
	buf := mem.Bytes()
	for i := range buf { // data, not zero pages
		buf[i] = byte(i*7 + i>>12)
	}
	l, err := p.Listen(ctx, *listen)
	if err != nil {
		return err
	}
	defer l.Close()
	fmt.Printf("listening %s\n", l.Addr())
	for {
		req, err := l.Accept(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		c, err := req.Prepare()
		if err != nil {
			req.Reject(nil)
			continue
		}
		r, err := c.Register(buf, allAccess)
		if err != nil {
			c.Close()
			return err
		}
		pd := make([]byte, 20)
		binary.LittleEndian.PutUint64(pd, r.Addr())
		binary.LittleEndian.PutUint32(pd[8:], r.RKey())
		binary.LittleEndian.PutUint64(pd[12:], uint64(size))
		if _, err := req.Accept(ctx, pd); err != nil {
			c.Close()
			continue
		}
		// One-sided requests need nothing of this side but a live
		// connection; Poll until the client goes (or we are stopped).
		go func() {
			defer c.Close()
			out := make([]transport.Completion, 16)
			for {
				if _, err := c.Poll(ctx, out); err != nil {
					return
				}
			}
		}()
	}
}

// job is one OP:BLOCKSIZE:DEPTH of -jobs.
type job struct {
	op        transport.Opcode
	name      string
	bs, depth int
}

func parseJobs(s string) ([]job, error) {
	var jobs []job
	for _, f := range strings.Split(s, ",") {
		parts := strings.Split(f, ":")
		if len(parts) != 3 {
			return nil, fmt.Errorf("job %q: want OP:BLOCKSIZE:DEPTH", f)
		}
		j := job{name: parts[0]}
		switch parts[0] {
		case "read":
			j.op = transport.OpRead
		case "write":
			j.op = transport.OpWrite
		default:
			return nil, fmt.Errorf("job %q: OP is read or write", f)
		}
		var err error
		if j.bs, err = parseSize(parts[1]); err != nil {
			return nil, fmt.Errorf("job %q: %w", f, err)
		}
		if j.depth, err = strconv.Atoi(parts[2]); err != nil || j.depth <= 0 {
			return nil, fmt.Errorf("job %q: DEPTH is a positive number", f)
		}
		jobs = append(jobs, j)
	}
	return jobs, nil
}

// result is what run prints for a job.
type result struct {
	Transport string  `json:"transport"`
	Mode      string  `json:"mode"`
	Op        string  `json:"op"`
	BS        int     `json:"bs"`
	Depth     int     `json:"qd"`
	IOs       int     `json:"ios"`
	Seconds   float64 `json:"seconds"`
	IOPS      float64 `json:"iops"`
	MBps      float64 `json:"MBps"`
	LatMean   float64 `json:"lat_mean_us"`
	LatP50    float64 `json:"lat_p50_us"`
	LatP99    float64 `json:"lat_p99_us"`
}

func run(args []string) error {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	target := fs.String("target", "", "address of rdmaread serve (required)")
	tname := fs.String("transport", "tcp", "transport provider: "+providers.Names)
	dur := fs.Duration("time", 3*time.Second, "how long each job runs (after a tenth of it as warm-up)")
	jobsS := fs.String("jobs", "read:4096:1,read:4096:32", "jobs OP:BLOCKSIZE:DEPTH, comma separated")
	fs.Parse(args)
	if *target == "" {
		return errors.New("run: -target is required")
	}
	jobs, err := parseJobs(*jobsS)
	if err != nil {
		return err
	}
	p, _, err := providers.Open(*tname, zap.NewNop())
	if err != nil {
		return err
	}
	enc := json.NewEncoder(os.Stdout)
	modes := []string{"poll", "handler"}
	for _, j := range jobs {
		for _, mode := range modes {
			res, err := runJob(p, *target, j, mode, *dur)
			if errors.Is(err, errNoHandler) {
				continue
			}
			if err != nil {
				return fmt.Errorf("%s %d QD%d (%s): %w", j.name, j.bs, j.depth, mode, err)
			}
			res.Transport = *tname
			if err := enc.Encode(res); err != nil {
				return err
			}
		}
	}
	return nil
}

var errNoHandler = errors.New("the connection delivers completions through Poll only")

// runJob connects (a connection per job and mode: nothing left over from
// the job before), keeps j.depth requests in flight for dur and measures.
func runJob(p transport.Provider, target string, j job, mode string, dur time.Duration) (result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), dur+30*time.Second)
	defer cancel()
	c, err := p.Dial(ctx, target, nil)
	if err != nil {
		return result{}, err
	}
	defer c.Close()
	pd := c.PeerPrivateData()
	if len(pd) < 20 {
		return result{}, fmt.Errorf("accept private data of %d bytes, want 20", len(pd))
	}
	raddr, rkey, rsize := binary.LittleEndian.Uint64(pd), binary.LittleEndian.Uint32(pd[8:]), int(binary.LittleEndian.Uint64(pd[12:]))
	if j.bs > rsize {
		return result{}, fmt.Errorf("block size %d larger than the server's %d bytes", j.bs, rsize)
	}
	if lim := c.Limits(); j.depth > lim.SendQueueDepth || (j.op == transport.OpRead && j.depth > lim.MaxReadsInFlight) {
		return result{}, fmt.Errorf("depth %d beyond the connection's limits %+v", j.depth, lim)
	}
	mem, err := transport.AllocMemory(j.bs*j.depth, false)
	if err != nil {
		return result{}, err
	}
	defer mem.Free()
	local, err := c.Register(mem.Bytes(), allAccess)
	if err != nil {
		return result{}, err
	}
	slots := rsize / j.bs

	posted := make([]time.Time, j.depth)
	inFlight := 0
	wrs := make([]transport.WorkRequest, 1)
	next := 0 // the next remote slot: a stride that visits the region spread out
	wr := func(slot int) transport.WorkRequest {
		w := transport.WorkRequest{ID: uint64(slot), Op: j.op,
			Local:      transport.SGE{Region: local, Offset: slot * j.bs, Length: j.bs},
			RemoteAddr: raddr + uint64((next%slots)*j.bs), RKey: rkey}
		next += 7919
		posted[slot] = time.Now()
		return w
	}
	post := func(slot int) error {
		wrs[0] = wr(slot)
		return c.PostSend(wrs...)
	}
	// postAll posts the first request of every slot in one call: after it
	// only complete touches the state above.
	postAll := func() error {
		all := make([]transport.WorkRequest, j.depth)
		for s := range all {
			all[s] = wr(s)
		}
		inFlight = j.depth
		return c.PostSend(all...)
	}
	warm := dur / 10
	measureFrom := time.Now().Add(warm)
	end := measureFrom.Add(dur)
	lats := make([]time.Duration, 0, 1<<16)
	var t0 time.Time
	// complete handles one completion where it arises (the polling
	// goroutine, or the Conn's own with a handler): no goroutine switch
	// of the harness's own between a completion and the next post.
	complete := func(x transport.Completion) error {
		now := time.Now()
		if x.Status != transport.StatusSuccess {
			return x.Err()
		}
		inFlight--
		if now.After(measureFrom) && posted[x.ID].After(measureFrom) {
			if t0.IsZero() {
				t0 = posted[x.ID]
			}
			lats = append(lats, now.Sub(posted[x.ID]))
		}
		if now.Before(end) {
			if err := post(int(x.ID)); err != nil {
				return err
			}
			inFlight++
		}
		return nil
	}
	switch mode {
	case "poll":
		if err := postAll(); err != nil {
			return result{}, err
		}
		out := make([]transport.Completion, 64)
		for inFlight > 0 {
			n, err := c.Poll(ctx, out)
			if err != nil {
				return result{}, err
			}
			for _, x := range out[:n] {
				if err := complete(x); err != nil {
					return result{}, err
				}
			}
		}
	case "handler":
		h, ok := c.(transport.CompletionHandler)
		if !ok {
			return result{}, errNoHandler
		}
		finished := make(chan error, 1)
		var failed error
		h.HandleCompletions(func(cs []transport.Completion, err error) {
			if failed != nil {
				return
			}
			if err == nil {
				for _, x := range cs {
					if err = complete(x); err != nil {
						break
					}
				}
			}
			if err != nil || inFlight == 0 {
				failed = err
				if err == nil {
					failed = errors.New("finished")
				}
				finished <- err
			}
		})
		if err := postAll(); err != nil {
			return result{}, err
		}
		select {
		case err := <-finished:
			if err != nil {
				return result{}, err
			}
		case <-ctx.Done():
			return result{}, ctx.Err()
		}
	}
	secs := time.Since(t0).Seconds()
	if len(lats) == 0 || t0.IsZero() {
		return result{}, errors.New("no request completed")
	}
	sort.Slice(lats, func(a, b int) bool { return lats[a] < lats[b] })
	var sum time.Duration
	for _, l := range lats {
		sum += l
	}
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	n := len(lats)
	return result{Mode: mode, Op: j.name, BS: j.bs, Depth: j.depth, IOs: n, Seconds: secs,
		IOPS: float64(n) / secs, MBps: float64(n) * float64(j.bs) / secs / 1e6,
		LatMean: us(sum) / float64(n), LatP50: us(lats[n/2]), LatP99: us(lats[n*99/100])}, nil
}
