package nbd

import (
	"encoding/binary"
	"fmt"
	"io"

	"go.uber.org/zap"
)

// maxOptionLength bounds the data of one option. The largest legitimate one
// is NBD_OPT_INFO/GO with a 4096-byte name and a few info requests; anything
// far beyond that is garbage and ends the connection.
const maxOptionLength = 64 << 10

// handshake runs the fixed newstyle negotiation and returns the export the
// client chose with NBD_OPT_GO or NBD_OPT_EXPORT_NAME.
func (c *conn) handshake() (*export, error) {
	var greet [18]byte
	binary.BigEndian.PutUint64(greet[0:], magicNBD)
	binary.BigEndian.PutUint64(greet[8:], magicIHaveOpt)
	binary.BigEndian.PutUint16(greet[16:], flagFixedNewstyle|flagNoZeroes)
	if _, err := c.nc.Write(greet[:]); err != nil {
		return nil, c.writeErr(err, "sending the greeting")
	}
	var cf [4]byte
	if _, err := io.ReadFull(c.br, cf[:]); err != nil {
		return nil, c.readErr(err, "reading the client flags")
	}
	clientFlags := binary.BigEndian.Uint32(cf[:])
	if clientFlags&^clientFlagsKnown != 0 {
		return nil, fmt.Errorf("%w: unknown client flags %#x", ErrProtocol, clientFlags)
	}
	noZeroes := clientFlags&clientFlagNoZeroes != 0

	var hdr [optHdrSize]byte
	for {
		if _, err := io.ReadFull(c.br, hdr[:]); err != nil {
			return nil, c.readErr(err, "reading an option")
		}
		if m := binary.BigEndian.Uint64(hdr[0:]); m != magicIHaveOpt {
			return nil, fmt.Errorf("%w: bad option magic %#016x", ErrProtocol, m)
		}
		opt := binary.BigEndian.Uint32(hdr[8:])
		n := binary.BigEndian.Uint32(hdr[12:])
		if n > maxOptionLength {
			return nil, fmt.Errorf("%w: option %d of %d bytes (limit %d)", ErrProtocol, opt, n, maxOptionLength)
		}
		data := make([]byte, n)
		if _, err := io.ReadFull(c.br, data); err != nil {
			return nil, c.readErr(err, "reading an option's data")
		}

		switch opt {
		case optExportName:
			x := c.s.lookup(string(data))
			if x == nil {
				// This option has no way to say no but closing.
				return nil, fmt.Errorf("%w: NBD_OPT_EXPORT_NAME for unknown export %q", errRefused, data)
			}
			b := make([]byte, 10, 10+124)
			binary.BigEndian.PutUint64(b[0:], x.size())
			binary.BigEndian.PutUint16(b[8:], x.flags)
			if !noZeroes {
				b = b[:10+124]
			}
			if _, err := c.nc.Write(b); err != nil {
				return nil, c.writeErr(err, "sending the export")
			}
			c.chosen(x, "NBD_OPT_EXPORT_NAME")
			return x, nil

		case optAbort:
			// The client may not wait for this; a failure to send it is fine.
			_ = c.optReply(opt, repAck, nil)
			return nil, errClientAbort

		case optList:
			if n != 0 {
				if err := c.optError(opt, repErrInvalid, "NBD_OPT_LIST takes no data"); err != nil {
					return nil, err
				}
				continue
			}
			for _, x := range c.s.exports {
				b := make([]byte, 4, 4+len(x.Name)+len(x.Description))
				binary.BigEndian.PutUint32(b, uint32(len(x.Name)))
				b = append(append(b, x.Name...), x.Description...)
				if err := c.optReply(opt, repServer, b); err != nil {
					return nil, err
				}
			}
			if err := c.optReply(opt, repAck, nil); err != nil {
				return nil, err
			}

		case optInfo, optGo:
			x, err := c.infoOrGo(opt, data)
			if err != nil {
				return nil, err
			}
			if x != nil && opt == optGo {
				c.chosen(x, "NBD_OPT_GO")
				return x, nil
			}

		default:
			// NBD_OPT_STRUCTURED_REPLY (simple replies only), NBD_OPT_STARTTLS,
			// the meta context and extended header options, anything newer.
			if err := c.optError(opt, repErrUnsup, fmt.Sprintf("option %d is not supported", opt)); err != nil {
				return nil, err
			}
		}
	}
}

func (c *conn) chosen(x *export, by string) {
	c.log.Info("nbd: export chosen", zap.String("export", x.Name), zap.String("by", by),
		zap.Uint64("size", x.size()), zap.Uint16("flags", x.flags))
}

// infoOrGo answers NBD_OPT_INFO or NBD_OPT_GO. It returns the export when the
// request was valid and the export exists, nil (and no error) after an error
// reply, and an error when the connection must end.
func (c *conn) infoOrGo(opt uint32, data []byte) (*export, error) {
	// u32 name length, name, u16 number of info requests, u16 each.
	if len(data) < 6 {
		return nil, c.optError(opt, repErrInvalid, "option data too short")
	}
	nameLen := binary.BigEndian.Uint32(data)
	if uint64(nameLen) > uint64(len(data)-6) {
		return nil, c.optError(opt, repErrInvalid, "name length beyond the option data")
	}
	name := string(data[4 : 4+nameLen])
	rest := data[4+nameLen:]
	nInfo := int(binary.BigEndian.Uint16(rest))
	rest = rest[2:]
	if len(rest) != 2*nInfo {
		return nil, c.optError(opt, repErrInvalid, "information request count does not match the option length")
	}
	x := c.s.lookup(name)
	if x == nil {
		return nil, c.optError(opt, repErrUnknown, fmt.Sprintf("no export named %q", name))
	}
	var wantName, wantDesc bool
	for i := 0; i < nInfo; i++ {
		switch binary.BigEndian.Uint16(rest[2*i:]) {
		case infoName:
			wantName = true
		case infoDescription:
			wantDesc = true
		}
	}

	b := make([]byte, 12)
	binary.BigEndian.PutUint16(b[0:], infoExport)
	binary.BigEndian.PutUint64(b[2:], x.size())
	binary.BigEndian.PutUint16(b[10:], x.flags)
	if err := c.optReply(opt, repInfo, b); err != nil {
		return nil, err
	}
	if wantName {
		b := binary.BigEndian.AppendUint16(nil, infoName)
		if err := c.optReply(opt, repInfo, append(b, x.Name...)); err != nil {
			return nil, err
		}
	}
	if wantDesc && x.Description != "" {
		b := binary.BigEndian.AppendUint16(nil, infoDescription)
		if err := c.optReply(opt, repInfo, append(b, x.Description...)); err != nil {
			return nil, err
		}
	}
	// Sent whether asked for or not (the spec allows it); the defaults are
	// the values a client assumes anyway.
	b = make([]byte, 14)
	binary.BigEndian.PutUint16(b[0:], infoBlockSize)
	binary.BigEndian.PutUint32(b[2:], x.min)
	binary.BigEndian.PutUint32(b[6:], x.pref)
	binary.BigEndian.PutUint32(b[10:], x.max)
	if err := c.optReply(opt, repInfo, b); err != nil {
		return nil, err
	}
	if err := c.optReply(opt, repAck, nil); err != nil {
		return nil, err
	}
	return x, nil
}

// optReply sends one option reply.
func (c *conn) optReply(opt, typ uint32, data []byte) error {
	b := make([]byte, 20, 20+len(data))
	binary.BigEndian.PutUint64(b[0:], magicOptReply)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], typ)
	binary.BigEndian.PutUint32(b[16:], uint32(len(data)))
	if _, err := c.nc.Write(append(b, data...)); err != nil {
		return c.writeErr(err, "sending an option reply")
	}
	return nil
}

// optError sends an error reply with a message for humans.
func (c *conn) optError(opt, typ uint32, msg string) error {
	return c.optReply(opt, typ, []byte(msg))
}
