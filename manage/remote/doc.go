// Package remote serves rblkd's remote management API (manage.proto, in
// package managepb) over gRPC with mutual TLS, and dials it.
//
// Only TLS 1.3 with a client certificate signed by the configured CA gets
// in; a client without one gets no answer at all (the handshake fails). A
// client is the Common Name of its certificate, and may manage the pools
// the server's Clients name for it ("*": all): any other pool's request is
// PermissionDenied, a certificate of no configured client is refused the
// same way, and one without a name is Unauthenticated. Errors of the
// Service are mapped to their gRPC codes (manage.CodeOf). Connections and
// requests at once are bounded (Options.MaxConns, MaxStreams), and so is a
// request's size.
//
// certs.go makes the certificates of a small installation: a CA, and the
// server and client certificates it signs (rblkd cert).
package remote
