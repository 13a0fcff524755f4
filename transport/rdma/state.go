//go:build linux

package rdma

import (
	"fmt"

	"go.uber.org/zap"
)

// connState is where a conn is in its life: its one state, in place of a
// set of flags. It only moves forward, through transition:
//
//	connecting  → established  the peer confirmed (ESTABLISHED): sends may
//	                           be posted and the CM goroutine runs
//	established → failing      a request was refused at post time: nothing
//	                           more is posted, the QP works on, and the
//	                           conn breaks when that request's turn comes
//	connecting, established,
//	failing     → draining     broken: the QP is in the error state and
//	                           flushes; Poll returns what is left, then
//	                           ErrClosed
//	connecting, established,
//	failing, draining → closed Close began (or the device went): Close
//	                           collects the flushes, Poll leaves the CQ
//	                           to it
//	closed      → destroyed    the verbs resources are gone
//
// Leaving connecting, established or failing for draining or closed stops
// the QP, once: rdma_disconnect if the conn was established (the peer is
// told), else a move of the QP to the error state (rdma_disconnect would
// not flush the receives of a QP never connected).
type connState uint32

const (
	stateConnecting connState = iota
	stateEstablished
	stateFailing
	stateDraining
	stateClosed
	stateDestroyed
)

var stateNames = [...]string{"connecting", "established", "failing", "draining", "closed", "destroyed"}

func (s connState) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("connState(%d)", uint32(s))
}

// transitionAllowed says which moves transition makes.
func transitionAllowed(from, to connState) bool {
	switch to {
	case stateEstablished:
		return from == stateConnecting
	case stateFailing:
		return from == stateEstablished
	case stateDraining:
		return from <= stateFailing
	case stateClosed:
		return from <= stateDraining
	case stateDestroyed:
		return from == stateClosed
	}
	return false
}

// state is the conn's state now. A caller that must not race a
// transition reads it under a lock that the transition's follower takes
// too (the rings' locks: see teardown).
func (c *conn) state() connState { return connState(c.st.Load()) }

// transition moves the conn to state to if transitionAllowed says so from
// where it is, and stops the QP if to leaves the working states (see
// connState), all under stateMu. cause, when the conn moves, is why it
// breaks or closes, unless an earlier cause was recorded (the first one
// is what Poll reports). It returns the state the conn was in, and
// whether it moved: exactly one caller moves it into each state, and
// that one owns what follows (Close's teardown, for closed).
func (c *conn) transition(to connState, cause error) (from connState, moved bool) {
	c.stateMu.Lock()
	defer c.stateMu.Unlock()
	from = c.state()
	if !transitionAllowed(from, to) {
		return from, false
	}
	if cause != nil && c.cause == nil {
		c.cause = cause
	}
	c.st.Store(uint32(to))
	if (to == stateDraining || to == stateClosed) && from <= stateFailing {
		c.stopQPLocked(from)
	}
	return from, true
}

// stopQPLocked moves the QP of a conn leaving state from to the error
// state (stateMu held; the id and QP are alive: teardown destroys them
// only after its own transition, under the same lock).
func (c *conn) stopQPLocked(from connState) {
	if from == stateConnecting {
		// Not connected (a conn of Prepare, or one whose accept failed):
		// rdma_disconnect would not flush the receives.
		if err := c.qp.ToError(); err != nil {
			c.log.Debug("rdma: moving the QP to the error state", zap.String("remote", c.remote), zap.Error(err))
		}
		return
	}
	if err := c.id.Disconnect(); err != nil {
		c.log.Debug("rdma_disconnect", zap.String("remote", c.remote), zap.Error(err))
	}
}
