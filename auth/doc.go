// Package auth is rblk's mutual authentication: a challenge-response with
// HMAC-SHA256 that a session runs before anything else, and the files that
// hold its secrets.
//
// The exchange, over the session's link (see package protocol):
//
//	initiator                                         target
//	AuthStart{host ID, Ci, have-secret}  ------------>  unknown host, or no secret while
//	                                                    the target requires one: Error(EACCES)
//	                                     <------------  AuthChallenge{target ID, Ct, required}
//	AuthResponse{Pi}                     ------------>  checks Pi: wrong, Error(EACCES) and close
//	                                     <------------  AuthAccept{Pt}
//	checks Pt: wrong, close
//
// where Pi = Proof(secret, RoleInitiator, host ID, target ID, Ci, Ct) and
// Pt = Proof(secret, RoleTarget, ...). Both challenges are fresh random
// bytes, so neither side can replay an old answer; the role is in the MAC,
// so neither side can reflect the other's answer back as its own; both
// identities are in it, so an answer for one host or target is worthless
// for another. Proofs are compared in constant time. The initiator proves
// first, so a stranger that connects learns nothing computed with the
// secret; secrets must be random (see README), not passwords, because a
// rogue target that an initiator was pointed at can try to guess the
// secret offline from Pi.
//
// A target without keys answers AuthChallenge without AuthRequired: the
// host ID is then a claim, not a proof. An initiator that has a secret
// refuses such a target, so that an attacker cannot downgrade it.
//
// Duties of the caller: keep secrets out of argv, logs, metrics and error
// texts (nothing in this package puts them there); load them with LoadKeys
// and ReadSecret, which refuse files that group or others may read.
package auth
