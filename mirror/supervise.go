package mirror

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// Leg is the attach of one member, as Supervise sees it.
type Leg interface {
	// Device is the member's device, "" when its attach has ended;
	// serving is false while the attach waits for its target (its IO
	// fails fast, or waits).
	Device() (dev string, serving bool)
	// Reattach attaches the member again after its attach ended, and
	// returns its device.
	Reattach(ctx context.Context) (string, error)
}

// Supervise keeps the array whole until ctx ends, looking every interval:
// a member whose attach ended (it lost writes, or gave up on its target)
// is attached again and added in full; a member md failed, or that is
// missing, is re-added from the bitmap once its attach serves again. o's
// Members are legs' devices.
func Supervise(ctx context.Context, o Options, legs []Leg, every time.Duration) {
	o.defaults()
	full := make([]bool, len(legs))
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		Check(ctx, o, legs, full)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Check is one look of Supervise; full[i] records that leg i must be
// added in full, until it is.
func Check(ctx context.Context, o Options, legs []Leg, full []bool) {
	o.defaults()
	for i, leg := range legs {
		dev, serving := leg.Device()
		if dev == "" {
			var err error
			if dev, err = leg.Reattach(ctx); err != nil {
				o.Logger.Warn("mirror member not attached again (trying again)", zap.String("array", o.Name), zap.Int("member", i), zap.Error(err))
				continue
			}
			full[i] = true
			serving = true
			o.Logger.Warn("mirror member attached again after its attach ended: it is copied in full", zap.String("array", o.Name),
				zap.Int("member", i), zap.String("device", dev))
		}
		if !serving {
			continue
		}
		st, err := Stat(o)
		if err != nil {
			o.Logger.Warn("mirror state", zap.String("array", o.Name), zap.Error(err))
			return
		}
		in := false
		for _, m := range st.Members {
			if m.Device == dev && !m.Faulty() {
				in = true
			}
		}
		if in {
			continue
		}
		if err := Add(ctx, o, dev, full[i]); err != nil {
			o.Logger.Warn("mirror member not added back (trying again)", zap.String("array", o.Name), zap.String("member", dev), zap.Error(err))
			continue
		}
		full[i] = false
	}
}
