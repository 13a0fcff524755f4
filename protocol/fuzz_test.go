package protocol_test

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/rblk/rblk/protocol"
)

// The seed corpora under testdata/fuzz are made from the golden and bad
// vectors: after changing those, run
//
//	go test ./protocol -run TestSeedCorpus -update-corpus
//
// Files the fuzzer adds there (inputs that once failed) are kept as they are.
var updateCorpus = flag.Bool("update-corpus", false, "rewrite the seed corpora in testdata/fuzz from the test vectors")

// decodeErrors are the errors Decode, ParseHeader and Unmarshal may return.
var decodeErrors = []error{
	protocol.ErrBadMagic, protocol.ErrVersion, protocol.ErrReserved, protocol.ErrTooLarge,
	protocol.ErrTruncated, protocol.ErrTrailing, protocol.ErrUnknownType, protocol.ErrBadField,
}

func checkDecodeError(t *testing.T, err error) {
	t.Helper()
	for _, s := range decodeErrors {
		if errors.Is(err, s) {
			return
		}
	}
	t.Fatalf("error %v is none of the decoding errors", err)
}

// messageSeeds are whole messages: the golden vectors, then the bad ones.
func messageSeeds() map[string][]byte {
	seeds := map[string][]byte{}
	for _, g := range goldens {
		seeds["golden-"+seedName(g.name)] = g.bytes()
	}
	for _, b := range bads {
		seeds["bad-"+seedName(b.name)] = unhex(b.hex)
	}
	return seeds
}

// payloadSeeds are the payloads of the message seeds of type typ.
func payloadSeeds(typ protocol.Type) map[string][]byte {
	seeds := map[string][]byte{}
	for name, b := range messageSeeds() {
		if len(b) >= protocol.HeaderSize && protocol.Type(b[5]) == typ {
			seeds[name] = b[protocol.HeaderSize:]
		}
	}
	return seeds
}

func seedName(s string) string {
	return strings.NewReplacer(" ", "-", "/", "-", ">", "gt", "<", "lt").Replace(strings.ToLower(s))
}

func addSeeds(f *testing.F, seeds map[string][]byte) {
	for _, name := range sortedKeys(seeds) {
		f.Add(seeds[name])
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// FuzzDecode decodes any bytes. It must never panic, and whatever decodes
// must encode back to the same bytes.
func FuzzDecode(f *testing.F) {
	addSeeds(f, messageSeeds())
	f.Fuzz(func(t *testing.T, b []byte) {
		h, m, err := protocol.Decode(b)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		if m.Type() != h.Type || m.Size() != int(h.Length) {
			t.Fatalf("header %+v for a %v of %d bytes", h, m.Type(), m.Size())
		}
		out, err := protocol.Append(nil, h.Credits, h.Tag, m)
		if err != nil {
			t.Fatalf("Append of a decoded %v: %v", h.Type, err)
		}
		if !bytes.Equal(out, b) {
			t.Fatalf("round trip of %#v:\n got %x\nwant %x", m, out, b)
		}
	})
}

// FuzzParseHeader parses any bytes as a header: what parses must Put back to
// the same bytes.
func FuzzParseHeader(f *testing.F) {
	addSeeds(f, messageSeeds())
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := protocol.ParseHeader(b)
		if err != nil {
			checkDecodeError(t, err)
			return
		}
		if h.Length > protocol.MaxMessageSize-protocol.HeaderSize {
			t.Fatalf("length %d accepted", h.Length)
		}
		var out [protocol.HeaderSize]byte
		h.Put(out[:])
		if !bytes.Equal(out[:], b[:protocol.HeaderSize]) {
			t.Fatalf("round trip of %+v:\n got %x\nwant %x", h, out, b[:protocol.HeaderSize])
		}
	})
}

// fuzzPayload fuzzes the Unmarshal of one type, as the data path uses it:
// what decodes must encode back to the same payload, and decode the same
// into a message that held another value.
func fuzzPayload(f *testing.F, typ protocol.Type) {
	addSeeds(f, payloadSeeds(typ))
	f.Fuzz(func(t *testing.T, p []byte) {
		m, err := protocol.New(typ)
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Unmarshal(p); err != nil {
			checkDecodeError(t, err)
			if !strings.HasPrefix(err.Error(), "decode "+typ.String()+": ") {
				t.Fatalf("error %q does not name the type", err)
			}
			return
		}
		if m.Size() != len(p) {
			t.Fatalf("Size = %d for %d bytes", m.Size(), len(p))
		}
		out := make([]byte, len(p))
		if n := m.MarshalTo(out); n != len(p) || !bytes.Equal(out, p) {
			t.Fatalf("MarshalTo = %d, %x; want %x", n, out, p)
		}
		msg, err := protocol.Append(nil, 0, 0, m)
		if err != nil {
			t.Fatalf("Append of a decoded %v: %v", typ, err)
		}
		if !bytes.Equal(msg[protocol.HeaderSize:], p) {
			t.Fatalf("Append:\n got %x\nwant %x", msg[protocol.HeaderSize:], p)
		}
		_, m2, err := protocol.Decode(msg)
		if err != nil || !reflect.DeepEqual(m, m2) {
			t.Fatalf("Decode = %#v, %v; want %#v", m2, err, m)
		}
		reused := dirty(typ)
		if err := reused.Unmarshal(p); err != nil || !sameMessage(reused, m) {
			t.Fatalf("Unmarshal into a used message = %#v, %v; want %#v", reused, err, m)
		}
	})
}

func FuzzHello(f *testing.F)         { fuzzPayload(f, protocol.TypeHello) }
func FuzzError(f *testing.F)         { fuzzPayload(f, protocol.TypeError) }
func FuzzExportList(f *testing.F)    { fuzzPayload(f, protocol.TypeExportList) }
func FuzzOpen(f *testing.F)          { fuzzPayload(f, protocol.TypeOpen) }
func FuzzAuthStart(f *testing.F)     { fuzzPayload(f, protocol.TypeAuthStart) }
func FuzzAuthChallenge(f *testing.F) { fuzzPayload(f, protocol.TypeAuthChallenge) }
func FuzzAuthResponse(f *testing.F)  { fuzzPayload(f, protocol.TypeAuthResponse) }
func FuzzVolumeInfo(f *testing.F)    { fuzzPayload(f, protocol.TypeVolumeInfo) }
func FuzzGrantRequest(f *testing.F)  { fuzzPayload(f, protocol.TypeGrantRequest) }
func FuzzGrant(f *testing.F)         { fuzzPayload(f, protocol.TypeGrant) }
func FuzzRevoke(f *testing.F)        { fuzzPayload(f, protocol.TypeRevoke) }
func FuzzRevokeAck(f *testing.F)     { fuzzPayload(f, protocol.TypeRevokeAck) }
func FuzzDone(f *testing.F)          { fuzzPayload(f, protocol.TypeDone) }
func FuzzFlush(f *testing.F)         { fuzzPayload(f, protocol.TypeFlush) }
func FuzzClose(f *testing.F)         { fuzzPayload(f, protocol.TypeClose) }
func FuzzTrim(f *testing.F)          { fuzzPayload(f, protocol.TypeTrim) }
func FuzzWriteZeroes(f *testing.F)   { fuzzPayload(f, protocol.TypeWriteZeroes) }
func FuzzJoin(f *testing.F)          { fuzzPayload(f, protocol.TypeJoin) }
func FuzzResize(f *testing.F)        { fuzzPayload(f, protocol.TypeResize) }

type negotiateSeed struct {
	lmin, lmax, pmin, pmax uint8
	lfeat, pfeat           uint32
}

var negotiateSeeds = map[string]negotiateSeed{
	"same":       {1, 1, 1, 1, 0, 0},
	"overlap":    {1, 3, 2, 5, 0xffffffff, 1},
	"disjoint":   {1, 1, 2, 3, 0, 0},
	"inverted":   {3, 1, 1, 3, 0, 0},
	"version-0":  {0, 0, 0, 1, 0, 0},
	"full-range": {0, 255, 0, 255, 0xffffffff, 0xffffffff},
}

// FuzzNegotiate checks that Negotiate picks the highest common version, and
// fails only when there is none.
func FuzzNegotiate(f *testing.F) {
	for _, name := range sortedKeys(negotiateSeeds) {
		s := negotiateSeeds[name]
		f.Add(s.lmin, s.lmax, s.pmin, s.pmax, s.lfeat, s.pfeat)
	}
	f.Fuzz(func(t *testing.T, lmin, lmax, pmin, pmax uint8, lfeat, pfeat uint32) {
		local := protocol.Hello{MinVersion: lmin, MaxVersion: lmax, Features: lfeat}
		peer := protocol.Hello{MinVersion: pmin, MaxVersion: pmax, Features: pfeat}
		v, feat, err := protocol.Negotiate(local, peer)
		common := func(v int) bool {
			return v >= 1 && v >= int(lmin) && v <= int(lmax) && v >= int(pmin) && v <= int(pmax)
		}
		best := 0
		for c := 1; c <= 255; c++ {
			if common(c) {
				best = c
			}
		}
		if best == 0 {
			if !errors.Is(err, protocol.ErrVersion) {
				t.Fatalf("Negotiate(%+v, %+v) = %d, %v; want ErrVersion", local, peer, v, err)
			}
			return
		}
		if err != nil || int(v) != best {
			t.Fatalf("Negotiate(%+v, %+v) = %d, %v; want %d", local, peer, v, err, best)
		}
		if feat&^(lfeat&pfeat&protocol.FeatureMask) != 0 {
			t.Fatalf("features %#x not offered by both", feat)
		}
	})
}

// corpusFile renders values in the format of Go's fuzzing corpus files.
func corpusFile(values ...any) []byte {
	var b bytes.Buffer
	b.WriteString("go test fuzz v1\n")
	for _, v := range values {
		switch v := v.(type) {
		case []byte:
			fmt.Fprintf(&b, "[]byte(%q)\n", v)
		case byte:
			fmt.Fprintf(&b, "byte(%q)\n", v)
		default:
			fmt.Fprintf(&b, "%T(%v)\n", v, v)
		}
	}
	return b.Bytes()
}

// seedCorpus is every seed corpus file made from the vectors, by path.
func seedCorpus() map[string][]byte {
	files := map[string][]byte{}
	add := func(fuzz string, seeds map[string][]byte) {
		for name, b := range seeds {
			files[filepath.Join("testdata", "fuzz", fuzz, name)] = corpusFile(b)
		}
	}
	add("FuzzDecode", messageSeeds())
	add("FuzzParseHeader", messageSeeds())
	for fuzz, typ := range map[string]protocol.Type{
		"FuzzHello": protocol.TypeHello, "FuzzError": protocol.TypeError,
		"FuzzExportList": protocol.TypeExportList, "FuzzOpen": protocol.TypeOpen,
		"FuzzVolumeInfo": protocol.TypeVolumeInfo, "FuzzGrantRequest": protocol.TypeGrantRequest,
		"FuzzGrant": protocol.TypeGrant, "FuzzRevoke": protocol.TypeRevoke,
		"FuzzRevokeAck": protocol.TypeRevokeAck, "FuzzDone": protocol.TypeDone,
		"FuzzFlush": protocol.TypeFlush, "FuzzClose": protocol.TypeClose,
		"FuzzTrim": protocol.TypeTrim, "FuzzWriteZeroes": protocol.TypeWriteZeroes,
		"FuzzAuthStart": protocol.TypeAuthStart, "FuzzAuthChallenge": protocol.TypeAuthChallenge,
		"FuzzAuthResponse": protocol.TypeAuthResponse, "FuzzJoin": protocol.TypeJoin,
		"FuzzResize": protocol.TypeResize,
	} {
		add(fuzz, payloadSeeds(typ))
	}
	for name, s := range negotiateSeeds {
		files[filepath.Join("testdata", "fuzz", "FuzzNegotiate", name)] =
			corpusFile(s.lmin, s.lmax, s.pmin, s.pmax, s.lfeat, s.pfeat)
	}
	return files
}

// fuzzerName matches the names go test -fuzz gives the inputs it writes.
var fuzzerName = regexp.MustCompile(`^[0-9a-f]{16}$`)

// TestSeedCorpus checks that the committed seed corpora hold every test
// vector, or rewrites them with -update-corpus.
func TestSeedCorpus(t *testing.T) {
	files := seedCorpus()
	for _, path := range sortedKeys(files) {
		want := files[path]
		if *updateCorpus {
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, want, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s is missing or stale (%v): run go test ./protocol -run TestSeedCorpus -update-corpus", path, err)
		}
	}
	// Generated files whose vector is gone. Inputs the fuzzer found, which
	// it names by a hash, are left alone.
	old, err := filepath.Glob(filepath.Join("testdata", "fuzz", "*", "*"))
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range old {
		if _, ok := files[path]; ok || fuzzerName.MatchString(filepath.Base(path)) {
			continue
		}
		if *updateCorpus {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			continue
		}
		t.Errorf("%s has no test vector: run go test ./protocol -run TestSeedCorpus -update-corpus", path)
	}
}
