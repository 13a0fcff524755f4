package protocol_test

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/rblk/rblk/protocol"
)

// unhex decodes a hex string, ignoring spaces.
func unhex(s string) []byte {
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		panic(fmt.Sprintf("bad hex %q: %v", s, err))
	}
	return b
}

// A golden vector: msg encoded with credits and tag gives exactly hex, and
// hex decodes back to msg. The bytes are written by hand from the layouts in
// doc.go, one line per header or group of fields.
type golden struct {
	name    string
	credits uint16
	tag     uint64
	msg     protocol.Message
	hex     string
}

func (g golden) bytes() []byte { return unhex(g.hex) }

func goldenBytes(t testing.TB, name string) []byte {
	for _, g := range goldens {
		if g.name == name {
			return g.bytes()
		}
	}
	t.Fatalf("no golden vector %q", name)
	return nil
}

var goldens = []golden{
	{
		name: "Hello",
		msg:  &protocol.Hello{MinVersion: 1, MaxVersion: 3, Features: 0x80000001, RecvCredits: 64, MaxMessage: 4096},
		hex: "52424c4b 01 01 0000 00000010 00000000 0000000000000000" + // RBLK v1 Hello, 0 credits, 16 bytes, rsvd, tag 0
			"01 03 0000 80000001" + // versions 1..3, rsvd, features (unknown bits kept)
			"0040 0000 00001000", // 64 recv credits, rsvd, max message 4096
	},
	{
		name:    "Error",
		credits: 1,
		tag:     0x0102030405060708,
		msg:     &protocol.ErrorMsg{Code: protocol.CodeStale, Text: "stale grant"},
		hex: "52424c4b 01 02 0001 00000011 00000000 0102030405060708" + // Error, 1 credit, 17 bytes, tag
			"00000074" + // code 116 ESTALE
			"000b 7374616c65206772616e74", // "stale grant"
	},
	{
		name:    "ListExports",
		credits: 2,
		tag:     1,
		msg:     &protocol.ListExports{},
		hex:     "52424c4b 01 03 0002 00000000 00000000 0000000000000001", // ListExports, 2 credits, no payload, tag 1
	},
	{
		name: "ExportList",
		tag:  1,
		msg: &protocol.ExportList{Exports: []protocol.ExportEntry{
			{Name: "vol0", Size: 1 << 30, Flags: protocol.VolCanTrim | protocol.VolCanZero | protocol.VolCanFlush},
			{Name: "ro", Size: 4096, Flags: protocol.VolReadOnly},
		}},
		hex: "52424c4b 01 04 0000 00000022 00000000 0000000000000001" + // ExportList, 34 bytes, tag 1
			"0002" + // 2 entries
			"04 766f6c30 0000000040000000 0000000e" + // "vol0", 1 GiB, trim|zero|flush
			"02 726f 0000000000001000 00000001", // "ro", 4096 bytes, read-only
	},
	{
		name: "ExportList/empty",
		tag:  1,
		msg:  &protocol.ExportList{},
		hex: "52424c4b 01 04 0000 00000002 00000000 0000000000000001" + // ExportList, 2 bytes, tag 1
			"0000", // no entries
	},
	{
		name: "Open",
		tag:  2,
		msg:  &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol0", HostID: "host-a"},
		hex: "52424c4b 01 05 0000 00000012 00000000 0000000000000002" + // Open, 18 bytes, tag 2
			"01 00 0004 0006 0000" + // read-write, no flags, name of 4 bytes, host ID of 6 bytes, rsvd
			"766f6c30" + // "vol0"
			"686f73742d61", // "host-a"
	},
	{
		name: "Join",
		tag:  4,
		msg:  &protocol.Join{Mode: protocol.ModeReadWrite, Name: "vol0", HostID: "host-a", Generation: 3},
		hex: "52424c4b 01 17 0000 0000001a 00000000 0000000000000004" + // Join, 26 bytes, tag 4
			"01 00 0004 0006 0000" + // read-write, no flags, name of 4 bytes, host ID of 6 bytes, rsvd
			"0000000000000003" + // session generation 3
			"766f6c30" + // "vol0"
			"686f73742d61", // "host-a"
	},
	{
		name: "Open/anonymous",
		tag:  9,
		msg:  &protocol.Open{Mode: protocol.ModeReadOnly, Name: "ro"},
		hex: "52424c4b 01 05 0000 0000000a 00000000 0000000000000009" + // Open, 10 bytes, tag 9
			"00 00 0002 0000 0000" + // read-only, rsvd, name of 2 bytes, no host ID, rsvd
			"726f", // "ro"
	},
	{
		name:    "VolumeInfo",
		credits: 3,
		tag:     2,
		msg: &protocol.VolumeInfo{Handle: 1, Flags: protocol.VolCanTrim | protocol.VolCanZero | protocol.VolCanFlush,
			VolumeSize: 1 << 30, BlockSize: 4096, ChunkSize: 2 << 20, Generation: 0x0000000100000003,
			Instance: 0x0123456789abcdef},
		hex: "52424c4b 01 06 0003 00000028 00000000 0000000000000002" + // VolumeInfo, 3 credits, 40 bytes, tag 2
			"00000001 0000000e" + // handle 1, trim|zero|flush
			"0000000040000000" + // 1 GiB
			"00001000 00200000" + // 4 KiB blocks, 2 MiB chunks
			"0000000100000003" + // session generation 0x100000003
			"0123456789abcdef", // target instance
	},
	{
		name: "GrantRequest",
		tag:  3,
		msg:  &protocol.GrantRequest{Handle: 1, Flags: protocol.GrantWrite, Offset: 0x300123},
		hex: "52424c4b 01 07 0000 00000010 00000000 0000000000000003" + // GrantRequest, 16 bytes, tag 3
			"00000001 00000001" + // handle 1, write
			"0000000000300123", // an offset in chunk 1
	},
	{
		name: "Grant",
		tag:  3,
		msg: &protocol.Grant{Handle: 1, Flags: protocol.GrantWrite, Offset: 0x200000,
			Addr: 0x7f1234560000, RKey: 0xdeadbeef, Length: 0x200000, Generation: 7},
		hex: "52424c4b 01 08 0000 00000028 00000000 0000000000000003" + // Grant, 40 bytes, tag 3
			"00000001 00000001" + // handle 1, write
			"0000000000200000" + // chunk 1 starts at 2 MiB
			"00007f1234560000" + // addr
			"deadbeef 00200000" + // rkey, 2 MiB
			"0000000000000007", // generation 7
	},
	{
		name:    "Revoke",
		credits: 1,
		tag:     0x8000000000000001,
		msg:     &protocol.Revoke{Handle: 1, Offset: 0x200000, Generation: 7},
		hex: "52424c4b 01 09 0001 00000018 00000000 8000000000000001" + // Revoke, 1 credit, 24 bytes, target's tag
			"00000001 00000000" + // handle 1, rsvd
			"0000000000200000" + // chunk at 2 MiB
			"0000000000000007", // generation 7
	},
	{
		name: "RevokeAck",
		tag:  0x8000000000000001,
		msg:  &protocol.RevokeAck{Handle: 1, Offset: 0x200000, Generation: 7},
		hex: "52424c4b 01 0a 0000 00000018 00000000 8000000000000001" + // RevokeAck, 24 bytes, the Revoke's tag
			"00000001 00000000" + // handle 1, rsvd
			"0000000000200000" + // chunk at 2 MiB
			"0000000000000007", // generation 7
	},
	{
		name:    "Done",
		credits: 5,
		tag:     4,
		msg: &protocol.Done{Handle: 1, Flags: protocol.DoneFUA, Generation: 0x0000000100000003, Ranges: []protocol.Range{
			{Offset: 0x200000, Length: 0x1000}, {Offset: 0x300000, Length: 0x200}}},
		hex: "52424c4b 01 0b 0005 00000038 00000000 0000000000000004" + // Done, 5 credits, 56 bytes, tag 4
			"00000001 00000001" + // handle 1, FUA
			"00000002 00000000" + // 2 ranges, rsvd
			"0000000100000003" + // session generation 0x100000003
			"0000000000200000 0000000000001000" + // 4 KiB at 2 MiB
			"0000000000300000 0000000000000200", // 512 bytes at 3 MiB
	},
	{
		name: "Done/one",
		tag:  5,
		msg:  &protocol.Done{Handle: 2, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 1}}},
		hex: "52424c4b 01 0b 0000 00000028 00000000 0000000000000005" + // Done, 40 bytes, tag 5
			"00000002 00000000" + // handle 2, no flags
			"00000001 00000000" + // 1 range, rsvd
			"0000000000000001" + // session generation 1
			"0000000000000000 0000000000000001", // 1 byte at 0
	},
	{
		name: "OK",
		tag:  4,
		msg:  &protocol.OK{},
		hex:  "52424c4b 01 0c 0000 00000000 00000000 0000000000000004", // OK, no payload, tag 4
	},
	{
		name: "Flush",
		tag:  5,
		msg:  &protocol.Flush{Handle: 1, Generation: 0x0000000100000003},
		hex: "52424c4b 01 0d 0000 00000010 00000000 0000000000000005" + // Flush, 16 bytes, tag 5
			"00000001 00000000" + // handle 1, rsvd
			"0000000100000003", // session generation 0x100000003
	},
	{
		name: "Trim",
		tag:  6,
		msg:  &protocol.Trim{Handle: 1, Flags: protocol.FlagFUA, Offset: 0x100000, Length: 0x10000},
		hex: "52424c4b 01 0e 0000 00000018 00000000 0000000000000006" + // Trim, 24 bytes, tag 6
			"00000001 00000001" + // handle 1, FUA
			"0000000000100000 0000000000010000", // 64 KiB at 1 MiB
	},
	{
		name: "WriteZeroes",
		tag:  7,
		msg:  &protocol.WriteZeroes{Handle: 1, Flags: protocol.FlagFUA | protocol.FlagNoHole, Offset: 0, Length: 0x1000},
		hex: "52424c4b 01 0f 0000 00000018 00000000 0000000000000007" + // WriteZeroes, 24 bytes, tag 7
			"00000001 00000003" + // handle 1, FUA|no-hole
			"0000000000000000 0000000000001000", // 4 KiB at 0
	},
	{
		name: "Close",
		tag:  8,
		msg:  &protocol.Close{Handle: 1},
		hex: "52424c4b 01 10 0000 00000008 00000000 0000000000000008" + // Close, 8 bytes, tag 8
			"00000001 00000000", // handle 1, rsvd
	},
	{
		name:    "Resize",
		credits: 2,
		msg:     &protocol.Resize{Handle: 1, VolumeSize: 3 << 30},
		hex: "52424c4b 01 18 0002 00000010 00000000 0000000000000000" + // Resize, 2 credits, 16 bytes, tag 0 (a notice)
			"00000001 00000000" + // handle 1, rsvd
			"00000000c0000000", // 3 GiB
	},
	{
		name:    "Credit",
		credits: 16,
		msg:     &protocol.Credit{},
		hex:     "52424c4b 01 11 0010 00000000 00000000 0000000000000000", // Credit, 16 credits, no payload, tag 0
	},
	{
		name: "Open/takeover",
		tag:  3,
		msg:  &protocol.Open{Mode: protocol.ModeReadWrite, Name: "v", HostID: "h", Flags: protocol.OpenTakeover},
		hex: "52424c4b 01 05 0000 0000000a 00000000 0000000000000003" + // Open, 10 bytes, tag 3
			"01 01 0001 0001 0000" + // read-write, takeover, name of 1 byte, host ID of 1 byte, rsvd
			"76 68", // "v", "h"
	},
	{
		name: "Open/instance",
		tag:  2,
		msg: &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol0", HostID: "host-a", Flags: protocol.OpenInstance,
			Instance: 0x0123456789abcdef},
		hex: "52424c4b 01 05 0000 0000001a 00000000 0000000000000002" + // Open, 26 bytes, tag 2
			"01 02 0004 0006 0000" + // read-write, instance, name of 4 bytes, host ID of 6 bytes, rsvd
			"0123456789abcdef" + // instance
			"766f6c30" + // "vol0"
			"686f73742d61", // "host-a"
	},
	{
		name: "Open/read-only-instance",
		tag:  5,
		msg:  &protocol.Open{Mode: protocol.ModeReadOnly, Name: "ro", Flags: protocol.OpenInstance, Instance: 1},
		hex: "52424c4b 01 05 0000 00000012 00000000 0000000000000005" + // Open, 18 bytes, tag 5
			"00 02 0002 0000 0000" + // read-only, instance, name of 2 bytes, no host ID, rsvd
			"0000000000000001" + // instance 1
			"726f", // "ro"
	},
	{
		name: "Open/takeover-instance",
		tag:  3,
		msg: &protocol.Open{Mode: protocol.ModeReadWrite, Name: "v", HostID: "h", Flags: protocol.OpenTakeover | protocol.OpenInstance,
			Instance: 0xfedcba9876543210},
		hex: "52424c4b 01 05 0000 00000012 00000000 0000000000000003" + // Open, 18 bytes, tag 3
			"01 03 0001 0001 0000" + // read-write, takeover|instance, name of 1 byte, host ID of 1 byte, rsvd
			"fedcba9876543210" + // instance
			"76 68", // "v", "h"
	},
	{
		name: "AuthStart",
		tag:  1,
		msg: &protocol.AuthStart{Flags: protocol.AuthHaveSecret, HostID: "host-a", Challenge: [32]byte{
			0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}},
		hex: "52424c4b 01 13 0000 0000002e 00000000 0000000000000001" + // AuthStart, 46 bytes, tag 1
			"01 00 0006 00000000" + // have secret, rsvd, host ID of 6 bytes, rsvd
			"000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f" + // challenge
			"686f73742d61", // "host-a"
	},
	{
		name: "AuthChallenge",
		tag:  1,
		msg:  &protocol.AuthChallenge{Flags: protocol.AuthRequired, TargetID: "tgt", Challenge: [32]byte{31: 0xff}},
		hex: "52424c4b 01 14 0000 0000002b 00000000 0000000000000001" + // AuthChallenge, 43 bytes, tag 1
			"01 00 0003 00000000" + // required, rsvd, target ID of 3 bytes, rsvd
			"00000000000000000000000000000000000000000000000000000000000000ff" + // challenge
			"746774", // "tgt"
	},
	{
		name: "AuthChallenge/unauthenticated",
		tag:  1,
		msg:  &protocol.AuthChallenge{TargetID: "", Challenge: [32]byte{0: 0xaa}},
		hex: "52424c4b 01 14 0000 00000028 00000000 0000000000000001" + // AuthChallenge, 40 bytes, tag 1
			"00 00 0000 00000000" + // not required, rsvd, no target ID, rsvd
			"aa00000000000000000000000000000000000000000000000000000000000000", // challenge
	},
	{
		name: "AuthResponse",
		tag:  2,
		msg:  &protocol.AuthResponse{Proof: [32]byte{0: 1, 31: 2}},
		hex: "52424c4b 01 15 0000 00000020 00000000 0000000000000002" + // AuthResponse, 32 bytes, tag 2
			"0100000000000000000000000000000000000000000000000000000000000002", // proof
	},
	{
		name: "AuthAccept",
		tag:  2,
		msg:  &protocol.AuthAccept{Proof: [32]byte{0: 3, 31: 4}},
		hex: "52424c4b 01 16 0000 00000020 00000000 0000000000000002" + // AuthAccept, 32 bytes, tag 2
			"0300000000000000000000000000000000000000000000000000000000000004", // proof
	},
	{
		name:    "KeepAlive",
		credits: 1,
		tag:     0x8000000000000002,
		msg:     &protocol.KeepAlive{},
		hex:     "52424c4b 01 12 0001 00000000 00000000 8000000000000002", // KeepAlive, 1 credit, no payload, target's tag
	},
}

func TestGolden(t *testing.T) {
	seen := map[protocol.Type]bool{}
	for _, g := range goldens {
		t.Run(g.name, func(t *testing.T) {
			want := g.bytes()
			got, err := protocol.Append(nil, g.credits, g.tag, g.msg)
			if err != nil {
				t.Fatalf("Append: %v", err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("Append:\n got %x\nwant %x", got, want)
			}
			// Append onto a prefix keeps the prefix.
			pre := []byte("prefix")
			got2, err := protocol.Append(pre, g.credits, g.tag, g.msg)
			if err != nil || !bytes.Equal(got2, append([]byte("prefix"), want...)) {
				t.Fatalf("Append onto a prefix: %x, %v", got2, err)
			}

			h, m, err := protocol.Decode(want)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			wantH := protocol.Header{Type: g.msg.Type(), Credits: g.credits, Length: uint32(len(want) - protocol.HeaderSize), Tag: g.tag}
			if h != wantH {
				t.Errorf("header = %+v, want %+v", h, wantH)
			}
			if !reflect.DeepEqual(m, g.msg) {
				t.Errorf("Decode = %#v, want %#v", m, g.msg)
			}
			if m.Size() != int(h.Length) {
				t.Errorf("Size = %d, want %d", m.Size(), h.Length)
			}

			// Hot path: ParseHeader, then Unmarshal into a message that
			// already holds another value.
			h2, err := protocol.ParseHeader(want)
			if err != nil || h2 != wantH {
				t.Fatalf("ParseHeader = %+v, %v", h2, err)
			}
			var hdr [protocol.HeaderSize]byte
			h2.Put(hdr[:])
			if !bytes.Equal(hdr[:], want[:protocol.HeaderSize]) {
				t.Errorf("Put = %x, want %x", hdr, want[:protocol.HeaderSize])
			}
			reused := dirty(g.msg.Type())
			if err := reused.Unmarshal(want[protocol.HeaderSize:]); err != nil {
				t.Fatalf("Unmarshal into a used message: %v", err)
			}
			if !sameMessage(reused, g.msg) {
				t.Errorf("Unmarshal into a used message = %#v, want %#v", reused, g.msg)
			}
		})
		seen[g.msg.Type()] = true
	}
	for typ := protocol.TypeHello; typ <= protocol.LastType; typ++ {
		if !seen[typ] {
			t.Errorf("no golden vector for %v", typ)
		}
	}
}

// dirty returns a message of type t that already holds the value of another
// golden vector of a type, when there is one, so that decoding into it tests
// that Unmarshal overwrites every field.
func dirty(t protocol.Type) protocol.Message {
	m, err := protocol.New(t)
	if err != nil {
		panic(err)
	}
	for i := len(goldens) - 1; i >= 0; i-- {
		g := goldens[i]
		if g.msg.Type() == t {
			if err := m.Unmarshal(g.bytes()[protocol.HeaderSize:]); err != nil {
				panic(err)
			}
			break
		}
	}
	switch m := m.(type) {
	case *protocol.Done:
		m.Ranges = append(m.Ranges, protocol.Range{Offset: 9, Length: 9}, protocol.Range{Offset: 8, Length: 8})
	case *protocol.ExportList:
		m.Exports = append(m.Exports, protocol.ExportEntry{Name: "stale", Size: 1})
	}
	return m
}

// sameMessage is reflect.DeepEqual, except that a nil slice and an empty one
// are the same: decoding into a used message keeps its (emptied) slices.
func sameMessage(a, b protocol.Message) bool {
	return reflect.DeepEqual(normalize(a), normalize(b))
}

func normalize(m protocol.Message) protocol.Message {
	switch m := m.(type) {
	case *protocol.ExportList:
		if len(m.Exports) == 0 {
			return &protocol.ExportList{}
		}
	case *protocol.Done:
		if len(m.Ranges) == 0 {
			c := *m
			c.Ranges = nil
			return &c
		}
	}
	return m
}

// A bad vector fails to decode with a given sentinel error.
type bad struct {
	name string
	hex  string
	want error
}

var bads = []bad{
	{"bad magic", "52424c4a 01 0c 0000 00000000 00000000 0000000000000004", protocol.ErrBadMagic},
	{"bad version", "52424c4b 02 0c 0000 00000000 00000000 0000000000000004", protocol.ErrVersion},
	{"version 0", "52424c4b 00 0c 0000 00000000 00000000 0000000000000004", protocol.ErrVersion},
	{"header reserved", "52424c4b 01 0c 0000 00000000 00000100 0000000000000004", protocol.ErrReserved},
	{"short header", "52424c4b 01 0c 0000 00000000 00000000 00000000000000", protocol.ErrTruncated},
	{"empty", "", protocol.ErrTruncated},
	{"too large", "52424c4b 01 0b 0000 00000fe9 00000000 0000000000000004", protocol.ErrTooLarge},
	{"huge length", "52424c4b 01 0b 0000 ffffffff 00000000 0000000000000004", protocol.ErrTooLarge},
	{"unknown type 0", "52424c4b 01 00 0000 00000000 00000000 0000000000000004", protocol.ErrUnknownType},
	{"unknown type 25", "52424c4b 01 19 0000 00000000 00000000 0000000000000004", protocol.ErrUnknownType},
	{"payload shorter than length", "52424c4b 01 0d 0000 00000010 00000000 0000000000000005 00000001 00000000", protocol.ErrTruncated},
	{"bytes after length", "52424c4b 01 0d 0000 00000010 00000000 0000000000000005 00000001 00000000 0000000000000003 00", protocol.ErrTrailing},
	{"payload too short for type", "52424c4b 01 08 0000 00000010 00000000 0000000000000003 00000001 00000001 0000000000200000", protocol.ErrTruncated},
	{"payload too long for type", "52424c4b 01 0d 0000 00000014 00000000 0000000000000005 00000001 00000000 0000000000000003 00000000", protocol.ErrTrailing},
	{"payload on OK", "52424c4b 01 0c 0000 00000001 00000000 0000000000000004 00", protocol.ErrTrailing},
	{"payload on Credit", "52424c4b 01 11 0000 00000004 00000000 0000000000000000 00000000", protocol.ErrTrailing},
	{"payload on KeepAlive", "52424c4b 01 12 0000 00000001 00000000 8000000000000002 00", protocol.ErrTrailing},
	{"Flush reserved", "52424c4b 01 0d 0000 00000010 00000000 0000000000000005 00000001 00000001 0000000000000003", protocol.ErrReserved},
	{"Flush generation 0", "52424c4b 01 0d 0000 00000010 00000000 0000000000000005 00000001 00000000 0000000000000000", protocol.ErrBadField},
	{"Flush generation truncated", "52424c4b 01 0d 0000 0000000c 00000000 0000000000000005 00000001 00000000 00000000", protocol.ErrTruncated},
	{"Flush without generation", "52424c4b 01 0d 0000 00000008 00000000 0000000000000005 00000001 00000000", protocol.ErrTruncated},
	{"Close reserved", "52424c4b 01 10 0000 00000008 00000000 0000000000000008 00000001 00000001", protocol.ErrReserved},
	{"Close too long", "52424c4b 01 10 0000 00000010 00000000 0000000000000008 00000001 00000000 0000000000000003", protocol.ErrTrailing},
	{"Revoke reserved", "52424c4b 01 09 0000 00000018 00000000 0000000000000001 00000001 80000000 0000000000200000 0000000000000007", protocol.ErrReserved},
	{"Open reserved", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 01 04 0004 0000 0000 766f6c30", protocol.ErrReserved},
	{"Open instance 0", "52424c4b 01 05 0000 00000014 00000000 0000000000000002 01 02 0004 0000 0000 0000000000000000 766f6c30", protocol.ErrBadField},
	{"Open instance missing", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 01 02 0004 0000 0000 766f6c30", protocol.ErrTruncated},
	{"Open instance short", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 01 02 0000 0000 0000 01020304", protocol.ErrTruncated},
	{"Open instance trailing", "52424c4b 01 05 0000 00000015 00000000 0000000000000002 01 02 0004 0000 0000 0000000000000001 766f6c30 00", protocol.ErrTrailing},
	{"Open instance takeover read-only", "52424c4b 01 05 0000 00000014 00000000 0000000000000002 00 03 0004 0000 0000 0000000000000001 766f6c30", protocol.ErrBadField},
	{"Open instance reserved", "52424c4b 01 05 0000 00000014 00000000 0000000000000002 01 06 0004 0000 0000 0000000000000001 766f6c30", protocol.ErrReserved},
	{"Open takeover read-only", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 00 01 0004 0000 0000 766f6c30", protocol.ErrBadField},
	{"AuthStart reserved", "52424c4b 01 13 0000 00000028 00000000 0000000000000001 00 01 0000 00000000" + strings.Repeat("00", 32), protocol.ErrReserved},
	{"AuthStart flags", "52424c4b 01 13 0000 00000028 00000000 0000000000000001 02 00 0000 00000000" + strings.Repeat("00", 32), protocol.ErrReserved},
	{"AuthStart short", "52424c4b 01 13 0000 00000027 00000000 0000000000000001 00 00 0000 00000000" + strings.Repeat("00", 31), protocol.ErrTruncated},
	{"AuthStart long ID", "52424c4b 01 13 0000 00000029 00000000 0000000000000001 00 00 0002 00000000" + strings.Repeat("00", 32) + "61", protocol.ErrTruncated},
	{"AuthStart NUL in ID", "52424c4b 01 13 0000 00000029 00000000 0000000000000001 00 00 0001 00000000" + strings.Repeat("00", 32) + "00", protocol.ErrBadField},
	{"AuthChallenge reserved", "52424c4b 01 14 0000 00000028 00000000 0000000000000001 00 00 0000 00000100" + strings.Repeat("00", 32), protocol.ErrReserved},
	{"AuthChallenge trailing", "52424c4b 01 14 0000 00000029 00000000 0000000000000001 00 00 0000 00000000" + strings.Repeat("00", 33), protocol.ErrTrailing},
	{"AuthResponse short", "52424c4b 01 15 0000 0000001f 00000000 0000000000000001 " + strings.Repeat("00", 31), protocol.ErrTruncated},
	{"AuthAccept long", "52424c4b 01 16 0000 00000021 00000000 0000000000000001 " + strings.Repeat("00", 33), protocol.ErrTrailing},
	{"Open reserved 2", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 01 00 0004 0000 0001 766f6c30", protocol.ErrReserved},
	{"Hello reserved", "52424c4b 01 01 0000 00000010 00000000 0000000000000000 01 01 0001 00000000 0040 0000 00001000", protocol.ErrReserved},
	{"Hello reserved 2", "52424c4b 01 01 0000 00000010 00000000 0000000000000000 01 01 0000 00000000 0040 8000 00001000", protocol.ErrReserved},
	{"Hello min > max", "52424c4b 01 01 0000 00000010 00000000 0000000000000000 02 01 0000 00000000 0040 0000 00001000", protocol.ErrBadField},
	{"Hello min 0", "52424c4b 01 01 0000 00000010 00000000 0000000000000000 00 01 0000 00000000 0040 0000 00001000", protocol.ErrBadField},
	{"GrantRequest undefined flag", "52424c4b 01 07 0000 00000010 00000000 0000000000000003 00000001 00000002 0000000000300123", protocol.ErrReserved},
	{"Grant undefined flag", "52424c4b 01 08 0000 00000028 00000000 0000000000000003 00000001 80000001 0000000000200000 00007f1234560000 deadbeef 00200000 0000000000000007", protocol.ErrReserved},
	{"VolumeInfo undefined flag", "52424c4b 01 06 0000 00000028 00000000 0000000000000002 00000001 00000010 0000000040000000 00001000 00200000 0000000000000003 0000000000000001", protocol.ErrReserved},
	{"VolumeInfo generation 0", "52424c4b 01 06 0000 00000028 00000000 0000000000000002 00000001 0000000e 0000000040000000 00001000 00200000 0000000000000000 0000000000000001", protocol.ErrBadField},
	{"VolumeInfo generation truncated", "52424c4b 01 06 0000 0000001c 00000000 0000000000000002 00000001 0000000e 0000000040000000 00001000 00200000 00000003", protocol.ErrTruncated},
	{"VolumeInfo without generation", "52424c4b 01 06 0000 00000018 00000000 0000000000000002 00000001 0000000e 0000000040000000 00001000 00200000", protocol.ErrTruncated},
	{"VolumeInfo without instance", "52424c4b 01 06 0000 00000020 00000000 0000000000000002 00000001 0000000e 0000000040000000 00001000 00200000 0000000000000003", protocol.ErrTruncated},
	{"VolumeInfo instance truncated", "52424c4b 01 06 0000 00000024 00000000 0000000000000002 00000001 0000000e 0000000040000000 00001000 00200000 0000000000000003 00000001", protocol.ErrTruncated},
	{"VolumeInfo trailing byte", "52424c4b 01 06 0000 00000029 00000000 0000000000000002 00000001 0000000e 0000000040000000 00001000 00200000 0000000000000003 0000000000000001 00", protocol.ErrTrailing},
	{"Trim no-hole", "52424c4b 01 0e 0000 00000018 00000000 0000000000000006 00000001 00000002 0000000000100000 0000000000010000", protocol.ErrReserved},
	{"Trim wraps", "52424c4b 01 0e 0000 00000018 00000000 0000000000000006 00000001 00000000 ffffffffffff0000 0000000000010000", protocol.ErrBadField},
	{"WriteZeroes undefined flag", "52424c4b 01 0f 0000 00000018 00000000 0000000000000007 00000001 00000004 0000000000000000 0000000000001000", protocol.ErrReserved},
	{"Join anonymous", "52424c4b 01 17 0000 00000014 00000000 0000000000000004 01 00 0004 0000 0000 0000000000000003 766f6c30", protocol.ErrBadField},
	{"Join generation 0", "52424c4b 01 17 0000 00000016 00000000 0000000000000004 01 00 0004 0002 0000 0000000000000000 766f6c30 6869", protocol.ErrBadField},
	{"Join flags", "52424c4b 01 17 0000 00000016 00000000 0000000000000004 01 01 0004 0002 0000 0000000000000003 766f6c30 6869", protocol.ErrReserved},
	{"Join reserved", "52424c4b 01 17 0000 00000016 00000000 0000000000000004 01 00 0004 0002 0100 0000000000000003 766f6c30 6869", protocol.ErrReserved},
	{"Join mode 2", "52424c4b 01 17 0000 00000016 00000000 0000000000000004 02 00 0004 0002 0000 0000000000000003 766f6c30 6869", protocol.ErrBadField},
	{"Join fixed part truncated", "52424c4b 01 17 0000 0000000c 00000000 0000000000000004 01 00 0004 0002 0000 00000000", protocol.ErrTruncated},
	{"Join host ID truncated", "52424c4b 01 17 0000 00000015 00000000 0000000000000004 01 00 0004 0002 0000 0000000000000003 766f6c30 68", protocol.ErrTruncated},
	{"Resize size 0", "52424c4b 01 18 0000 00000010 00000000 0000000000000000 00000001 00000000 0000000000000000", protocol.ErrBadField},
	{"Resize reserved", "52424c4b 01 18 0000 00000010 00000000 0000000000000000 00000001 00000100 00000000c0000000", protocol.ErrReserved},
	{"Resize truncated", "52424c4b 01 18 0000 0000000c 00000000 0000000000000000 00000001 00000000 00000000", protocol.ErrTruncated},
	{"Resize trailing", "52424c4b 01 18 0000 00000011 00000000 0000000000000000 00000001 00000000 00000000c0000000 00", protocol.ErrTrailing},
	{"Join trailing", "52424c4b 01 17 0000 00000017 00000000 0000000000000004 01 00 0004 0002 0000 0000000000000003 766f6c30 6869 00", protocol.ErrTrailing},
	{"Open empty name", "52424c4b 01 05 0000 00000008 00000000 0000000000000002 01 00 0000 0000 0000", protocol.ErrBadField},
	{"Open empty name with host ID", "52424c4b 01 05 0000 0000000e 00000000 0000000000000002 01 00 0000 0006 0000 686f73742d61", protocol.ErrBadField},
	{"Open name with NUL", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 01 00 0004 0000 0000 766f0030", protocol.ErrBadField},
	{"Open name not UTF-8", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 01 00 0004 0000 0000 766fff30", protocol.ErrBadField},
	{"Open name too long", "52424c4b 01 05 0000 00000008 00000000 0000000000000002 01 00 0100 0000 0000", protocol.ErrBadField},
	{"Open name truncated", "52424c4b 01 05 0000 0000000b 00000000 0000000000000002 01 00 0004 0000 0000 766f6c", protocol.ErrTruncated},
	{"Open name trailing", "52424c4b 01 05 0000 0000000d 00000000 0000000000000002 01 00 0004 0000 0000 766f6c30 00", protocol.ErrTrailing},
	{"Open mode 2", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 02 00 0004 0000 0000 766f6c30", protocol.ErrBadField},
	{"Open fixed part truncated", "52424c4b 01 05 0000 00000006 00000000 0000000000000002 01 00 0004 0006", protocol.ErrTruncated},
	{"Open host ID with NUL", "52424c4b 01 05 0000 00000012 00000000 0000000000000002 01 00 0004 0006 0000 766f6c30 686f7300 2d61", protocol.ErrBadField},
	{"Open host ID not UTF-8", "52424c4b 01 05 0000 00000012 00000000 0000000000000002 01 00 0004 0006 0000 766f6c30 686f73ff 2d61", protocol.ErrBadField},
	{"Open host ID too long", "52424c4b 01 05 0000 0000000c 00000000 0000000000000002 01 00 0004 0100 0000 766f6c30", protocol.ErrBadField},
	{"Open host ID truncated", "52424c4b 01 05 0000 00000011 00000000 0000000000000002 01 00 0004 0006 0000 766f6c30 686f73742d", protocol.ErrTruncated},
	{"Open host ID trailing", "52424c4b 01 05 0000 00000013 00000000 0000000000000002 01 00 0004 0006 0000 766f6c30 686f73742d61 00", protocol.ErrTrailing},
	{"ExportList empty name", "52424c4b 01 04 0000 0000000f 00000000 0000000000000001 0001 00 0000000040000000 0000000e", protocol.ErrBadField},
	{"ExportList bad name", "52424c4b 01 04 0000 00000010 00000000 0000000000000001 0001 01 c3 0000000040000000 0000000e", protocol.ErrBadField},
	{"ExportList undefined flag", "52424c4b 01 04 0000 00000010 00000000 0000000000000001 0001 01 61 0000000040000000 0000001e", protocol.ErrReserved},
	{"ExportList count too big", "52424c4b 01 04 0000 00000010 00000000 0000000000000001 0002 01 61 0000000040000000 0000000e", protocol.ErrTruncated},
	{"ExportList count too small", "52424c4b 01 04 0000 00000010 00000000 0000000000000001 0000 01 61 0000000040000000 0000000e", protocol.ErrTrailing},
	{"ExportList entry truncated", "52424c4b 01 04 0000 0000000f 00000000 0000000000000001 0001 01 61 0000000040000000 000000", protocol.ErrTruncated},
	{"Error code 0", "52424c4b 01 02 0000 00000006 00000000 0000000000000001 00000000 0000", protocol.ErrBadField},
	{"Error text not UTF-8", "52424c4b 01 02 0000 00000007 00000000 0000000000000001 00000005 0001 80", protocol.ErrBadField},
	{"Error text too long", "52424c4b 01 02 0000 00000006 00000000 0000000000000001 00000005 0401", protocol.ErrBadField},
	{"Error text truncated", "52424c4b 01 02 0000 00000007 00000000 0000000000000001 00000005 0002 61", protocol.ErrTruncated},
	{"Done 0 ranges", "52424c4b 01 0b 0000 00000018 00000000 0000000000000004 00000001 00000000 00000000 00000000 0000000000000003", protocol.ErrBadField},
	{"Done 254 ranges", "52424c4b 01 0b 0000 00000018 00000000 0000000000000004 00000001 00000000 000000fe 00000000 0000000000000003", protocol.ErrBadField},
	{"Done count beyond payload", "52424c4b 01 0b 0000 00000028 00000000 0000000000000004 00000001 00000000 00000002 00000000 0000000000000003 0000000000000000 0000000000000001", protocol.ErrTruncated},
	{"Done count 0 with a range", "52424c4b 01 0b 0000 00000028 00000000 0000000000000004 00000001 00000000 00000000 00000000 0000000000000003 0000000000000000 0000000000000001", protocol.ErrBadField},
	{"Done extra range", "52424c4b 01 0b 0000 00000038 00000000 0000000000000004 00000001 00000000 00000001 00000000 0000000000000003 0000000000000000 0000000000000001 0000000000000000 0000000000000001", protocol.ErrTrailing},
	{"Done empty range", "52424c4b 01 0b 0000 00000028 00000000 0000000000000004 00000001 00000000 00000001 00000000 0000000000000003 0000000000001000 0000000000000000", protocol.ErrBadField},
	{"Done range wraps", "52424c4b 01 0b 0000 00000028 00000000 0000000000000004 00000001 00000000 00000001 00000000 0000000000000003 fffffffffffff000 0000000000001000", protocol.ErrBadField},
	{"Done undefined flag", "52424c4b 01 0b 0000 00000028 00000000 0000000000000004 00000001 00000002 00000001 00000000 0000000000000003 0000000000000000 0000000000000001", protocol.ErrReserved},
	{"Done reserved", "52424c4b 01 0b 0000 00000028 00000000 0000000000000004 00000001 00000000 00000001 00000001 0000000000000003 0000000000000000 0000000000000001", protocol.ErrReserved},
	{"Done generation 0", "52424c4b 01 0b 0000 00000028 00000000 0000000000000004 00000001 00000000 00000001 00000000 0000000000000000 0000000000000000 0000000000000001", protocol.ErrBadField},
	{"Done generation truncated", "52424c4b 01 0b 0000 00000014 00000000 0000000000000004 00000001 00000000 00000001 00000000 00000000", protocol.ErrTruncated},
	{"Done without generation", "52424c4b 01 0b 0000 00000020 00000000 0000000000000004 00000001 00000000 00000001 00000000 0000000000001000 0000000000000200", protocol.ErrTruncated},
}

func TestDecodeErrors(t *testing.T) {
	for _, c := range bads {
		t.Run(c.name, func(t *testing.T) {
			h, m, err := protocol.Decode(unhex(c.hex))
			if !errors.Is(err, c.want) {
				t.Fatalf("Decode = %+v, %#v, %v; want %v", h, m, err, c.want)
			}
			if m != nil {
				t.Errorf("Decode returned a message with error %v", err)
			}
		})
	}
}

func TestDecodeErrorText(t *testing.T) {
	for _, c := range bads {
		if c.name != "Done empty range" {
			continue
		}
		_, _, err := protocol.Decode(unhex(c.hex))
		if err == nil || !strings.HasPrefix(err.Error(), "decode Done: ") {
			t.Errorf("error %q does not say what was decoded", err)
		}
		return
	}
	t.Fatal("no such vector")
}

// Payloads longer than any message fail to decode, whatever their start.
func TestUnmarshalOversized(t *testing.T) {
	for _, g := range goldens {
		p := append(g.bytes()[protocol.HeaderSize:], make([]byte, protocol.MaxPayloadSize)...)
		m, _ := protocol.New(g.msg.Type())
		if err := m.Unmarshal(p); !errors.Is(err, protocol.ErrTrailing) && !errors.Is(err, protocol.ErrTooLarge) {
			t.Errorf("%s: Unmarshal of %d bytes = %v", g.name, len(p), err)
		}
	}
	// An export list that would be valid but for its size.
	var l protocol.ExportList
	for range 300 {
		l.Exports = append(l.Exports, protocol.ExportEntry{Name: "export-name", Size: 1})
	}
	p := make([]byte, l.Size())
	l.MarshalTo(p)
	if err := new(protocol.ExportList).Unmarshal(p); !errors.Is(err, protocol.ErrTooLarge) {
		t.Errorf("Unmarshal of a %d-byte export list = %v", len(p), err)
	}
}

func TestParseHeaderDoesNotNeedPayload(t *testing.T) {
	b := goldens[1].bytes()[:protocol.HeaderSize] // Error, without its payload
	h, err := protocol.ParseHeader(b)
	if err != nil || h.Type != protocol.TypeError || h.Length != 17 {
		t.Fatalf("ParseHeader = %+v, %v", h, err)
	}
	// Unknown types are for the caller to reject.
	b[5] = 99
	if h, err := protocol.ParseHeader(b); err != nil || h.Type != 99 {
		t.Fatalf("ParseHeader of type 99 = %+v, %v", h, err)
	}
}

func TestAppendErrors(t *testing.T) {
	long := strings.Repeat("a", protocol.MaxNameLen+1)
	ranges := func(n int) []protocol.Range {
		r := make([]protocol.Range, n)
		for i := range r {
			r[i] = protocol.Range{Offset: uint64(i) << 12, Length: 1 << 12}
		}
		return r
	}
	many := make([]protocol.ExportEntry, 300)
	for i := range many {
		many[i] = protocol.ExportEntry{Name: fmt.Sprintf("export-%03d", i), Size: 1}
	}
	cases := []struct {
		name string
		msg  protocol.Message
		want error
	}{
		{"nil", nil, protocol.ErrBadField},
		{"Open name too long", &protocol.Open{Name: long}, protocol.ErrBadField},
		{"Open empty name", &protocol.Open{}, protocol.ErrBadField},
		{"Open NUL", &protocol.Open{Name: "a\x00b"}, protocol.ErrBadField},
		{"Open not UTF-8", &protocol.Open{Name: "a\xffb"}, protocol.ErrBadField},
		{"Open mode", &protocol.Open{Mode: 7, Name: "vol0"}, protocol.ErrBadField},
		{"Open host ID too long", &protocol.Open{Name: "vol0", HostID: long}, protocol.ErrBadField},
		{"Open host ID NUL", &protocol.Open{Name: "vol0", HostID: "h\x00"}, protocol.ErrBadField},
		{"Open host ID not UTF-8", &protocol.Open{Name: "vol0", HostID: "h\xff"}, protocol.ErrBadField},
		{"Open instance without its flag", &protocol.Open{Name: "vol0", HostID: "h", Instance: 7}, protocol.ErrBadField},
		{"Open instance flag without an instance", &protocol.Open{Name: "vol0", HostID: "h", Flags: protocol.OpenInstance}, protocol.ErrBadField},
		{"ExportList name too long", &protocol.ExportList{Exports: []protocol.ExportEntry{{Name: long}}}, protocol.ErrBadField},
		{"ExportList too large", &protocol.ExportList{Exports: many}, protocol.ErrTooLarge},
		{"ExportList flags", &protocol.ExportList{Exports: []protocol.ExportEntry{{Name: "a", Flags: 1 << 9}}}, protocol.ErrReserved},
		{"Done no ranges", &protocol.Done{Handle: 1, Generation: 1}, protocol.ErrBadField},
		{"Done too many ranges", &protocol.Done{Handle: 1, Generation: 1, Ranges: ranges(protocol.MaxDoneRanges + 1)}, protocol.ErrBadField},
		{"Done empty range", &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 1}}}, protocol.ErrBadField},
		{"Done flags", &protocol.Done{Handle: 1, Flags: 4, Generation: 1, Ranges: ranges(1)}, protocol.ErrReserved},
		{"Done generation 0", &protocol.Done{Handle: 1, Ranges: ranges(1)}, protocol.ErrBadField},
		{"Flush generation 0", &protocol.Flush{Handle: 1}, protocol.ErrBadField},
		{"Error text too long", &protocol.ErrorMsg{Code: protocol.CodeIO, Text: strings.Repeat("x", protocol.MaxErrorText+1)}, protocol.ErrBadField},
		{"Error text not UTF-8", &protocol.ErrorMsg{Code: protocol.CodeIO, Text: "\xff"}, protocol.ErrBadField},
		{"Error code 0", &protocol.ErrorMsg{Text: "x"}, protocol.ErrBadField},
		{"Hello versions", &protocol.Hello{MinVersion: 2, MaxVersion: 1}, protocol.ErrBadField},
		{"GrantRequest flags", &protocol.GrantRequest{Flags: 2}, protocol.ErrReserved},
		{"Grant flags", &protocol.Grant{Flags: 2}, protocol.ErrReserved},
		{"VolumeInfo flags", &protocol.VolumeInfo{Flags: 16, Generation: 1}, protocol.ErrReserved},
		{"VolumeInfo generation 0", &protocol.VolumeInfo{Handle: 1}, protocol.ErrBadField},
		{"Trim no-hole", &protocol.Trim{Flags: protocol.FlagNoHole}, protocol.ErrReserved},
		{"WriteZeroes wraps", &protocol.WriteZeroes{Offset: 1 << 63, Length: 1 << 63}, protocol.ErrBadField},
		{"foreign message", foreign{}, protocol.ErrUnknownType},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dst := []byte("keep")
			got, err := protocol.Append(dst, 0, 1, c.msg)
			if !errors.Is(err, c.want) {
				t.Fatalf("Append = %v, want %v", err, c.want)
			}
			if string(got) != "keep" {
				t.Errorf("Append changed dst to %q", got)
			}
		})
	}
}

// foreign is a Message of a type this package does not know.
type foreign struct{}

func (foreign) Type() protocol.Type      { return 200 }
func (foreign) Size() int                { return 0 }
func (foreign) MarshalTo([]byte) int     { return 0 }
func (foreign) Unmarshal(p []byte) error { return nil }

func TestLimits(t *testing.T) {
	if protocol.MaxDoneRanges != 253 {
		t.Errorf("MaxDoneRanges = %d", protocol.MaxDoneRanges)
	}
	d := &protocol.Done{Handle: 1, Generation: 1, Ranges: make([]protocol.Range, protocol.MaxDoneRanges)}
	for i := range d.Ranges {
		d.Ranges[i] = protocol.Range{Offset: uint64(i), Length: 1}
	}
	b, err := protocol.Append(nil, 0, 0, d)
	if err != nil || len(b) > protocol.MaxMessageSize {
		t.Fatalf("Done with MaxDoneRanges: %d bytes, %v", len(b), err)
	}
	if len(b)+16 <= protocol.MaxMessageSize {
		t.Errorf("one more range would still fit: %d bytes", len(b))
	}
	if _, m, err := protocol.Decode(b); err != nil || !reflect.DeepEqual(m, d) {
		t.Errorf("Decode of the largest Done: %v", err)
	}

	// A Hello is connection private data: 56 bytes at most.
	b, err = protocol.Append(nil, 0, 0, &protocol.Hello{MinVersion: 1, MaxVersion: 1})
	if err != nil || len(b) > 56 {
		t.Errorf("Hello takes %d bytes (%v), more than 56", len(b), err)
	}

	// The largest Error and Open fit.
	for _, m := range []protocol.Message{
		&protocol.ErrorMsg{Code: protocol.CodeIO, Text: strings.Repeat("é", protocol.MaxErrorText/2)},
		&protocol.Open{Name: strings.Repeat("n", protocol.MaxNameLen), HostID: strings.Repeat("h", protocol.MaxNameLen),
			Flags: protocol.OpenTakeover | protocol.OpenInstance, Instance: ^uint64(0), Mode: protocol.ModeReadWrite},
		&protocol.ExportList{Exports: []protocol.ExportEntry{{Name: strings.Repeat("n", protocol.MaxNameLen)}}},
	} {
		b, err := protocol.Append(nil, 0, 0, m)
		if err != nil {
			t.Errorf("Append %v: %v", m.Type(), err)
			continue
		}
		if _, m2, err := protocol.Decode(b); err != nil || !reflect.DeepEqual(m, m2) {
			t.Errorf("Decode %v: %v", m.Type(), err)
		}
	}
}

func TestNew(t *testing.T) {
	for typ := protocol.TypeHello; typ <= protocol.LastType; typ++ {
		m, err := protocol.New(typ)
		if err != nil || m.Type() != typ {
			t.Errorf("New(%v) = %v, %v", typ, m, err)
		}
		if strings.HasPrefix(typ.String(), "Type(") {
			t.Errorf("%d has no name", typ)
		}
	}
	for _, typ := range []protocol.Type{0, protocol.LastType + 1, 255} {
		if _, err := protocol.New(typ); !errors.Is(err, protocol.ErrUnknownType) {
			t.Errorf("New(%d) = %v", typ, err)
		}
	}
	if s := protocol.Type(42).String(); s != "Type(42)" {
		t.Errorf("Type(42).String() = %q", s)
	}
	if s := protocol.TypeWriteZeroes.String(); s != "WriteZeroes" {
		t.Errorf("TypeWriteZeroes.String() = %q", s)
	}
}

func TestNegotiate(t *testing.T) {
	h := func(lo, hi uint8, f uint32) protocol.Hello {
		return protocol.Hello{MinVersion: lo, MaxVersion: hi, Features: f}
	}
	cases := []struct {
		local, peer protocol.Hello
		version     uint8
		ok          bool
	}{
		{h(1, 1, 0), h(1, 1, 0), 1, true},
		{h(1, 3, 0), h(2, 5, 0), 3, true},
		{h(2, 5, 0), h(1, 3, 0), 3, true},
		{h(1, 1, 0), h(2, 3, 0), 0, false},
		{h(3, 4, 0), h(1, 2, 0), 0, false},
		{h(2, 1, 0), h(1, 2, 0), 0, false}, // inverted local range
		{h(0, 0, 0), h(0, 0, 0), 0, false}, // version 0 does not exist
		{h(0, 1, 0), h(0, 4, 0), 1, true},
	}
	for _, c := range cases {
		v, f, err := protocol.Negotiate(c.local, c.peer)
		if c.ok && (err != nil || v != c.version) {
			t.Errorf("Negotiate(%+v, %+v) = %d, %v; want %d", c.local, c.peer, v, err, c.version)
		}
		if !c.ok && !errors.Is(err, protocol.ErrVersion) {
			t.Errorf("Negotiate(%+v, %+v) = %d, %v; want ErrVersion", c.local, c.peer, v, err)
		}
		if f != 0 {
			t.Errorf("features %#x", f)
		}
	}
	// Unknown feature bits are dropped.
	if _, f, err := protocol.Negotiate(h(1, 1, 0xffffffff), h(1, 1, 0xffffffff)); err != nil || f != protocol.FeatureMask {
		t.Errorf("features = %#x, %v", f, err)
	}
	// The instance in Open is used only when both sides offer it: a peer
	// of before it (no features) gets Opens without it.
	all := protocol.FeatureMask
	if _, f, err := protocol.Negotiate(h(1, 1, all), h(1, 1, all)); err != nil || f&protocol.FeatureOpenInstance == 0 {
		t.Errorf("both offer FeatureOpenInstance: features = %#x, %v", f, err)
	}
	if _, f, err := protocol.Negotiate(h(1, 1, all), h(1, 1, 0)); err != nil || f&protocol.FeatureOpenInstance != 0 {
		t.Errorf("an older peer: features = %#x, %v", f, err)
	}
}

func TestRemoteError(t *testing.T) {
	sentinels := map[protocol.ErrorCode]error{
		protocol.CodePerm:     protocol.ErrPerm,
		protocol.CodeNoEnt:    protocol.ErrNoExport,
		protocol.CodeIO:       protocol.ErrIO,
		protocol.CodeBusy:     protocol.ErrBusy,
		protocol.CodeInval:    protocol.ErrInvalid,
		protocol.CodeNoSpc:    protocol.ErrNoSpace,
		protocol.CodeRange:    protocol.ErrRange,
		protocol.CodeProto:    protocol.ErrProtocol,
		protocol.CodeShutdown: protocol.ErrShutdown,
		protocol.CodeStale:    protocol.ErrStale,
	}
	for code, sentinel := range sentinels {
		err := fmt.Errorf("wrapped: %w", (&protocol.ErrorMsg{Code: code, Text: "x"}).Err())
		if !errors.Is(err, sentinel) {
			t.Errorf("%v does not match %v", err, sentinel)
		}
		for other, s := range sentinels {
			if other != code && errors.Is(err, s) {
				t.Errorf("%v matches %v", err, s)
			}
		}
		if got := protocol.CodeOf(err); got != code {
			t.Errorf("CodeOf(%v) = %v", err, got)
		}
		if got := protocol.CodeOf(fmt.Errorf("ctx: %w", sentinel)); got != code {
			t.Errorf("CodeOf(%v) = %v, want %v", sentinel, got, code)
		}
		if strings.HasPrefix(code.String(), "ErrorCode(") {
			t.Errorf("code %d has no name", code)
		}
	}
	if s := protocol.CodeStale.String(); s != "ESTALE" {
		t.Errorf("CodeStale.String() = %q", s)
	}
	if s := protocol.ErrorCode(99).String(); s != "ErrorCode(99)" {
		t.Errorf("ErrorCode(99).String() = %q", s)
	}
	err := &protocol.RemoteError{Code: protocol.CodeStale, Text: "generation 7 revoked"}
	if s := err.Error(); s != "remote error ESTALE: generation 7 revoked" {
		t.Errorf("Error() = %q", s)
	}
	if s := (&protocol.RemoteError{Code: protocol.CodeIO}).Error(); s != "remote error EIO" {
		t.Errorf("Error() = %q", s)
	}
	unknown := &protocol.RemoteError{Code: 99}
	for _, s := range sentinels {
		if errors.Is(unknown, s) {
			t.Errorf("unknown code matches %v", s)
		}
	}
	if protocol.CodeOf(unknown) != 99 {
		t.Errorf("CodeOf does not pass an unknown remote code on")
	}
}

func TestCodeOf(t *testing.T) {
	cases := []struct {
		err  error
		want protocol.ErrorCode
	}{
		{nil, 0},
		{errors.New("whatever"), protocol.CodeIO},
		{syscall.EPERM, protocol.CodePerm},
		{syscall.EACCES, protocol.CodePerm},
		{syscall.EROFS, protocol.CodePerm},
		{syscall.ENOENT, protocol.CodeNoEnt},
		{syscall.EIO, protocol.CodeIO},
		{syscall.EBUSY, protocol.CodeBusy},
		{syscall.EINVAL, protocol.CodeInval},
		{syscall.EOPNOTSUPP, protocol.CodeInval},
		{syscall.ENOSPC, protocol.CodeNoSpc},
		{syscall.EDQUOT, protocol.CodeNoSpc},
		{syscall.EFBIG, protocol.CodeRange},
		{syscall.ERANGE, protocol.CodeRange},
		{syscall.EPROTO, protocol.CodeProto},
		{syscall.ESHUTDOWN, protocol.CodeShutdown},
		{syscall.ESTALE, protocol.CodeStale},
		{syscall.EMFILE, protocol.CodeIO},
		{&fs.PathError{Op: "open", Path: "/x", Err: syscall.ENOENT}, protocol.CodeNoEnt},
		{&fs.PathError{Op: "fallocate", Path: "/x", Err: syscall.ENOSPC}, protocol.CodeNoSpc},
		{fs.ErrPermission, protocol.CodePerm},
		{fs.ErrNotExist, protocol.CodeNoEnt},
		{fs.ErrClosed, protocol.CodeShutdown},
		{fmt.Errorf("decode Done: %w", protocol.ErrTruncated), protocol.CodeProto},
		{protocol.ErrBadField, protocol.CodeProto},
		{protocol.ErrVersion, protocol.CodeProto},
		// A sentinel wins over the errno it wraps.
		{fmt.Errorf("%w: %w", protocol.ErrStale, syscall.EIO), protocol.CodeStale},
	}
	for _, c := range cases {
		if got := protocol.CodeOf(c.err); got != c.want {
			t.Errorf("CodeOf(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

func TestErrorFor(t *testing.T) {
	m := protocol.ErrorFor(&fs.PathError{Op: "pwrite", Path: "/v", Err: syscall.ENOSPC})
	if m.Code != protocol.CodeNoSpc || m.Text != "pwrite /v: no space left on device" {
		t.Errorf("ErrorFor = %+v", m)
	}
	// Long and invalid texts are cut and mended so that the message encodes.
	long := errors.New("\xff" + strings.Repeat("é", protocol.MaxErrorText))
	m = protocol.ErrorFor(long)
	if len(m.Text) > protocol.MaxErrorText {
		t.Errorf("text of %d bytes", len(m.Text))
	}
	if _, err := protocol.Append(nil, 0, 1, m); err != nil {
		t.Errorf("Append(ErrorFor(long)): %v", err)
	}
	// A remote error is passed on.
	re := &protocol.RemoteError{Code: protocol.CodeStale, Text: "gone"}
	if m := protocol.ErrorFor(fmt.Errorf("grant: %w", re)); m.Code != protocol.CodeStale || m.Text != "gone" {
		t.Errorf("ErrorFor(remote) = %+v", m)
	}
	if err := (&protocol.ErrorMsg{Code: protocol.CodeBusy, Text: "later"}).Err(); !errors.Is(err, protocol.ErrBusy) {
		t.Errorf("Err() = %v", err)
	}
}

func TestStrings(t *testing.T) {
	for _, c := range []struct {
		got, want string
	}{
		{protocol.VolumeFlags(0).String(), "none"},
		{(protocol.VolReadOnly | protocol.VolCanFlush).String(), "read-only|flush"},
		{(protocol.VolCanTrim | 0x100).String(), "trim|0x100"},
		{protocol.ModeReadWrite.String(), "read-write"},
		{protocol.Mode(5).String(), "Mode(5)"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}

// The data path decodes into reused messages and encodes into reused
// buffers without allocating.
func TestHotPathDoesNotAllocate(t *testing.T) {
	done := goldenBytes(t, "Done")
	grant := goldenBytes(t, "Grant")
	flush := goldenBytes(t, "Flush")
	buf := make([]byte, 0, protocol.MaxMessageSize)
	var d protocol.Done
	var g protocol.Grant
	var f protocol.Flush
	req := &protocol.GrantRequest{Handle: 1, Flags: protocol.GrantWrite, Offset: 42}
	dm := &protocol.Done{Handle: 1, Generation: 3, Ranges: []protocol.Range{{Offset: 0, Length: 4096}}}
	fm := &protocol.Flush{Handle: 1, Generation: 3}
	allocs := testing.AllocsPerRun(100, func() {
		h, err := protocol.ParseHeader(done)
		if err != nil {
			panic(err)
		}
		if err := d.Unmarshal(done[protocol.HeaderSize : protocol.HeaderSize+h.Length]); err != nil {
			panic(err)
		}
		if err := g.Unmarshal(grant[protocol.HeaderSize:]); err != nil {
			panic(err)
		}
		if err := f.Unmarshal(flush[protocol.HeaderSize:]); err != nil {
			panic(err)
		}
		if buf, err = protocol.Append(buf[:0], 1, 2, req); err != nil {
			panic(err)
		}
		if buf, err = protocol.Append(buf[:0], 1, 2, dm); err != nil {
			panic(err)
		}
		if buf, err = protocol.Append(buf[:0], 1, 2, fm); err != nil {
			panic(err)
		}
	})
	if allocs != 0 {
		t.Errorf("%v allocations per run", allocs)
	}
}
