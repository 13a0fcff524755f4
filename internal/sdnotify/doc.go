// Package sdnotify tells systemd how a service is doing, as sd_notify(3)
// does: READY=1 once it serves, RELOADING=1 while it reloads its
// configuration, STOPPING=1 when it shuts down, and a free-form STATUS=.
//
// A unit of Type=notify (or notify-reload) gets $NOTIFY_SOCKET, the path of
// a unix datagram socket, or an abstract socket's name when it starts with
// '@'. Without $NOTIFY_SOCKET (not run by systemd, or another Type=) every
// function does nothing and returns nil, so callers need no check.
//
// The package has no state: the socket is dialled for each message, which
// is what the protocol expects (one datagram per message, no connection).
package sdnotify
