// Package config reads and writes rblkd's configuration file
// (/etc/rblk/rblkd.yaml): its settings, named like the flags of rblkd
// serve in snake_case (listen, cache_size, ...), and its exports. Every
// mistake is reported with the file, the line and the field
// ("rblkd.yaml:12: exports[1].size: ..."), unknown keys included. Changes
// made at run time (rblkd export add --save) edit the parsed document, so
// that the file keeps its comments and order, and are written back
// atomically: Stage writes and syncs the new content beside the file
// before the change it records is made, Commit renames it over the file
// once the change is made (Abort if it was refused). The file is read
// through package safeopen: a FIFO or another non-regular file is refused
// at once, never waited on.
package config
