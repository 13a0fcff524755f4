package protocol_test

import (
	"fmt"
	"testing"

	"github.com/rblk/rblk/protocol"
)

func doneWith(n int) *protocol.Done {
	d := &protocol.Done{Handle: 1, Flags: protocol.DoneFUA, Generation: 1, Ranges: make([]protocol.Range, n)}
	for i := range d.Ranges {
		d.Ranges[i] = protocol.Range{Offset: uint64(i) << 16, Length: 4096}
	}
	return d
}

var doneSizes = []int{1, 16, protocol.MaxDoneRanges}

// BenchmarkAppendDone encodes a Done into a reused buffer, as the initiator
// does into its registered send buffers.
func BenchmarkAppendDone(b *testing.B) {
	for _, n := range doneSizes {
		b.Run(fmt.Sprintf("ranges=%d", n), func(b *testing.B) {
			d := doneWith(n)
			buf := make([]byte, 0, protocol.MaxMessageSize)
			b.SetBytes(int64(protocol.HeaderSize + d.Size()))
			b.ReportAllocs()
			var err error
			for b.Loop() {
				buf, err = protocol.Append(buf[:0], 1, 42, d)
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkParseDone decodes a Done into a reused message, as the target
// does for each receive completion. It does not allocate.
func BenchmarkParseDone(b *testing.B) {
	for _, n := range doneSizes {
		b.Run(fmt.Sprintf("ranges=%d", n), func(b *testing.B) {
			msg, err := protocol.Append(nil, 1, 42, doneWith(n))
			if err != nil {
				b.Fatal(err)
			}
			var d protocol.Done
			b.SetBytes(int64(len(msg)))
			b.ReportAllocs()
			for b.Loop() {
				h, err := protocol.ParseHeader(msg)
				if err != nil {
					b.Fatal(err)
				}
				if h.Type != protocol.TypeDone || int(h.Length) > len(msg)-protocol.HeaderSize {
					b.Fatal("bad header")
				}
				if err := d.Unmarshal(msg[protocol.HeaderSize : protocol.HeaderSize+h.Length]); err != nil {
					b.Fatal(err)
				}
			}
			if len(d.Ranges) != n {
				b.Fatalf("%d ranges", len(d.Ranges))
			}
		})
	}
}

// BenchmarkGrantRoundTrip is the control-path cost of one grant: the
// initiator encodes a GrantRequest, the target decodes it and encodes the
// Grant, the initiator decodes that.
func BenchmarkGrantRoundTrip(b *testing.B) {
	reqBuf := make([]byte, 0, protocol.MaxMessageSize)
	repBuf := make([]byte, 0, protocol.MaxMessageSize)
	var (
		req  = protocol.GrantRequest{Handle: 1, Flags: protocol.GrantWrite}
		treq protocol.GrantRequest
		rep  protocol.Grant
		got  protocol.Grant
		err  error
	)
	b.ReportAllocs()
	tag := uint64(0)
	for b.Loop() {
		tag++
		req.Offset = tag << 21
		if reqBuf, err = protocol.Append(reqBuf[:0], 0, tag, &req); err != nil {
			b.Fatal(err)
		}

		h, err := protocol.ParseHeader(reqBuf)
		if err != nil || h.Type != protocol.TypeGrantRequest {
			b.Fatal(h, err)
		}
		if err := treq.Unmarshal(reqBuf[protocol.HeaderSize:]); err != nil {
			b.Fatal(err)
		}
		rep = protocol.Grant{Handle: treq.Handle, Flags: treq.Flags, Offset: treq.Offset &^ (1<<21 - 1),
			Addr: 0x7f0000000000, RKey: 0x1234, Length: 1 << 21, Generation: h.Tag}
		if repBuf, err = protocol.Append(repBuf[:0], 1, h.Tag, &rep); err != nil {
			b.Fatal(err)
		}

		h, err = protocol.ParseHeader(repBuf)
		if err != nil || h.Type != protocol.TypeGrant || h.Tag != tag {
			b.Fatal(h, err)
		}
		if err := got.Unmarshal(repBuf[protocol.HeaderSize:]); err != nil {
			b.Fatal(err)
		}
	}
	if got != rep {
		b.Fatalf("got %+v, want %+v", got, rep)
	}
}
