package protocol

// LastType is the highest message type this package knows, for the tests of
// package protocol_test that go through every type.
const LastType = typeMax
