package target

import (
	"time"
)

// RateLimit is a token bucket: Burst events at once, then one more every
// Every.
type RateLimit struct {
	Burst int
	Every time.Duration
}

// buckets are token buckets by key, in bounded memory: at most max keys.
// A bucket that has refilled is the same as no bucket, so it is dropped
// when room is needed; if every bucket still counts, the fullest one
// (the key least limited) goes. No locks and no clock of its own: the
// caller locks and passes the time.
type buckets struct {
	limit RateLimit
	max   int
	m     map[string]*bucket
}

type bucket struct {
	tokens float64
	at     time.Time // when tokens was computed
	// suppressed counts what was refused since the last event allowed
	// (the log limiter reports it then).
	suppressed uint64
}

func newBuckets(limit RateLimit, maxKeys int) *buckets {
	return &buckets{limit: limit, max: maxKeys, m: make(map[string]*bucket)}
}

// refill brings b's tokens to now.
func (bs *buckets) refill(b *bucket, now time.Time) {
	if el := now.Sub(b.at); el > 0 && bs.limit.Every > 0 {
		b.tokens = min(float64(bs.limit.Burst), b.tokens+float64(el)/float64(bs.limit.Every))
		b.at = now
	}
}

// peek returns key's bucket brought to now, or nil if it has none (a full
// bucket).
func (bs *buckets) peek(key string, now time.Time) *bucket {
	b := bs.m[key]
	if b != nil {
		bs.refill(b, now)
	}
	return b
}

// get returns key's bucket brought to now, making a full one if needed.
func (bs *buckets) get(key string, now time.Time) *bucket {
	if b := bs.peek(key, now); b != nil {
		return b
	}
	if len(bs.m) >= bs.max {
		bs.makeRoom(now)
	}
	b := &bucket{tokens: float64(bs.limit.Burst), at: now}
	bs.m[key] = b
	return b
}

// makeRoom drops the buckets that refilled; if none did, the fullest.
func (bs *buckets) makeRoom(now time.Time) {
	var fullest string
	best := -1.0
	for k, b := range bs.m {
		bs.refill(b, now)
		if b.tokens >= float64(bs.limit.Burst) && b.suppressed == 0 {
			delete(bs.m, k)
			continue
		}
		if b.tokens > best {
			fullest, best = k, b.tokens
		}
	}
	if len(bs.m) >= bs.max {
		delete(bs.m, fullest)
	}
}

// allowed reports whether key has a token now, without taking it.
func (bs *buckets) allowed(key string, now time.Time) bool {
	b := bs.peek(key, now)
	return b == nil || b.tokens >= 1
}

// take takes a token of key and reports whether there was one (false: the
// key is over its limit; the bucket stays empty).
func (bs *buckets) take(key string, now time.Time) bool {
	b := bs.get(key, now)
	if b.tokens >= 1 {
		b.tokens--
		return true
	}
	return false
}

// wait is how long until key has a token again.
func (bs *buckets) wait(key string, now time.Time) time.Duration {
	b := bs.peek(key, now)
	if b == nil || b.tokens >= 1 {
		return 0
	}
	return time.Duration((1 - b.tokens) * float64(bs.limit.Every))
}

// len is the number of keys kept.
func (bs *buckets) len() int { return len(bs.m) }
