//go:build linux

package rdma

import (
	"bytes"
	"testing"
)

func TestPrivateDataFraming(t *testing.T) {
	for _, capacity := range []int{MaxConnectPrivateData, MaxAcceptPrivateData, MaxRejectPrivateData + 1} {
		for _, n := range []int{0, 1, 17, capacity - 1, capacity} {
			if n == capacity && capacity == MaxRejectPrivateData+1 {
				continue // a reject always has its length byte
			}
			pd := bytes.Repeat([]byte{0}, n) // zeros: what the padding is made of
			enc, flow := encodePrivateData(pd, capacity)
			if len(enc) > capacity {
				t.Fatalf("%d bytes in a field of %d encode to %d", n, capacity, len(enc))
			}
			// The CM delivers the whole field, zero-padded.
			field := make([]byte, capacity)
			copy(field, enc)
			got, err := decodePrivateData(field, flow, capacity)
			if err != nil || !bytes.Equal(got, pd) || len(got) != n {
				t.Errorf("%d bytes in a field of %d: got %d bytes, %v", n, capacity, len(got), err)
			}
		}
	}
	if _, err := decodePrivateData([]byte{9, 1, 2}, 0, 56); err == nil {
		t.Error("a length beyond the data was accepted")
	}
}
