// Package admin is rblkd's local admin socket (/run/rblk/rblkd.sock by
// default): one JSON Request and one JSON Response per connection, from
// root (or the daemon's own user) only, checked with SO_PEERCRED. It lists,
// adds, removes and grows exports at run time and reloads the
// configuration file; `rblkd export` is its command-line client, and other
// tools may use Do. The socket's path belongs to the process that holds
// its lock file, PATH.lock (see Listen): of two rblkd started at once, one
// serves on it and the other is told it is in use (ErrInUse).
package admin
