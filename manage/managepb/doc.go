// Package managepb is the Go code that manage.proto, rblkd's remote
// management API, generates (scripts/gen-proto.sh; the test command checks
// that it is up to date). Package manage/remote serves it.
package managepb
