package nbd

import "github.com/pojntfx/go-nbd/pkg/protocol"

// Wire values of the NBD protocol (doc/proto.md of the reference
// implementation). Where go-nbd's pkg/protocol defines a value, and its value
// is right (each one below was checked against the specification), it is
// used, so that the two stay one definition; the values it lacks are defined
// here. go-nbd's struct types are not used: they exist for binary.Read and
// binary.Write, which reflect and allocate on every call, and the hot path
// here encodes fixed-size arrays with binary.BigEndian instead.
const (
	// Handshake magics.
	magicNBD      = protocol.NEGOTIATION_MAGIC_OLDSTYLE // "NBDMAGIC"
	magicIHaveOpt = protocol.NEGOTIATION_MAGIC_OPTION   // "IHAVEOPT"
	magicOptReply = protocol.NEGOTIATION_MAGIC_REPLY    // 0x3e889045565a9

	// Handshake flags (server → client, 16 bits).
	flagFixedNewstyle = protocol.NEGOTIATION_HANDSHAKE_FLAG_FIXED_NEWSTYLE // 1 << 0
	flagNoZeroes      = uint16(1 << 1)                                     // missing in go-nbd

	// Client flags (client → server, 32 bits); missing in go-nbd.
	clientFlagFixedNewstyle = uint32(1 << 0)
	clientFlagNoZeroes      = uint32(1 << 1)
	clientFlagsKnown        = clientFlagFixedNewstyle | clientFlagNoZeroes

	// Options.
	optExportName       = uint32(1)                            // missing in go-nbd
	optAbort            = protocol.NEGOTIATION_ID_OPTION_ABORT // 2
	optList             = protocol.NEGOTIATION_ID_OPTION_LIST  // 3
	optStartTLS         = uint32(5)                            // missing in go-nbd
	optInfo             = protocol.NEGOTIATION_ID_OPTION_INFO  // 6
	optGo               = protocol.NEGOTIATION_ID_OPTION_GO    // 7
	optStructuredReply  = uint32(8)                            // missing in go-nbd
	optListMetaContext  = uint32(9)                            // missing in go-nbd
	optSetMetaContext   = uint32(10)                           // missing in go-nbd
	optExtendedHeaders  = uint32(11)                           // missing in go-nbd
	optionNameMaxLength = 4096                                 // the spec's limit on names and descriptions

	// Option reply types.
	repAck        = protocol.NEGOTIATION_TYPE_REPLY_ACK             // 1
	repServer     = protocol.NEGOTIATION_TYPE_REPLY_SERVER          // 2
	repInfo       = protocol.NEGOTIATION_TYPE_REPLY_INFO            // 3
	repErrUnsup   = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNSUPPORTED // 2^31 + 1
	repErrInvalid = uint32(1<<31 | 3)                               // missing in go-nbd
	repErrUnknown = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNKNOWN     // 2^31 + 6

	// Information types of NBD_REP_INFO.
	infoExport      = protocol.NEGOTIATION_TYPE_INFO_EXPORT      // 0
	infoName        = protocol.NEGOTIATION_TYPE_INFO_NAME        // 1
	infoDescription = protocol.NEGOTIATION_TYPE_INFO_DESCRIPTION // 2
	infoBlockSize   = protocol.NEGOTIATION_TYPE_INFO_BLOCKSIZE   // 3

	// Transmission flags (16 bits). go-nbd has only HAS_FLAGS and
	// CAN_MULTI_CONN.
	tflagHasFlags        = protocol.NEGOTIATION_REPLY_FLAGS_HAS_FLAGS // 1 << 0
	tflagReadOnly        = uint16(1 << 1)
	tflagSendFlush       = uint16(1 << 2)
	tflagSendFUA         = uint16(1 << 3)
	tflagSendTrim        = uint16(1 << 5)
	tflagSendWriteZeroes = uint16(1 << 6)
	tflagCanMultiConn    = protocol.NEGOTIATION_REPLY_FLAGS_CAN_MULTI_CONN // 1 << 8

	// Transmission magics.
	magicRequest     = protocol.TRANSMISSION_MAGIC_REQUEST // 0x25609513
	magicSimpleReply = protocol.TRANSMISSION_MAGIC_REPLY   // 0x67446698

	// Commands. go-nbd has only READ, WRITE and DISC.
	cmdRead        = protocol.TRANSMISSION_TYPE_REQUEST_READ  // 0
	cmdWrite       = protocol.TRANSMISSION_TYPE_REQUEST_WRITE // 1
	cmdDisc        = protocol.TRANSMISSION_TYPE_REQUEST_DISC  // 2
	cmdFlush       = uint16(3)
	cmdTrim        = uint16(4)
	cmdWriteZeroes = uint16(6)

	// Command flags; missing in go-nbd.
	cmdFlagFUA    = uint16(1 << 0)
	cmdFlagNoHole = uint16(1 << 1)

	// Error values on the wire. They are the Linux errno numbers whatever the
	// host is; go-nbd has only EPERM and EINVAL.
	errPerm     = protocol.TRANSMISSION_ERROR_EPERM // 1
	errIO       = uint32(5)
	errNoMem    = uint32(12)
	errInval    = protocol.TRANSMISSION_ERROR_EINVAL // 22
	errNoSpc    = uint32(28)
	errOverflow = uint32(75)
	errNotSup   = uint32(95)
	errShutdown = uint32(108)
)

// Sizes.
const (
	requestSize  = 28       // simple request: magic, flags, type, cookie, offset, length
	replySize    = 16       // simple reply: magic, error, cookie
	optHdrSize   = 16       // option: magic, option, length
	hardMaxBlock = 32 << 20 // the largest request length accepted at all
)
