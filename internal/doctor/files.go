package doctor

import (
	"fmt"
	"io/fs"
	"os"
	"syscall"
)

// checkPrivateFile checks a file that holds secrets: it exists, is a
// regular file, is readable by neither group nor others, and is owned by
// root or the daemon's user. what names it in the fix ("--auth-file").
func (e Env) checkPrivateFile(c Check, path, what string) (Check, bool) {
	st, err := os.Stat(path)
	switch {
	case os.IsNotExist(err):
		c.Detail = path + " does not exist"
		c.Fix = fmt.Sprintf("create it (mode 0600) or give the right %s (see README, Security)", what)
		return c, false
	case err != nil:
		c.Detail = err.Error()
		c.Fix = "run as the user the daemon runs as (root)"
		return c, false
	case !st.Mode().IsRegular():
		c.Detail = fmt.Sprintf("%s is not a regular file (%s)", path, st.Mode().Type())
		c.Fix = fmt.Sprintf("give %s a regular file", what)
		return c, false
	case st.Mode().Perm()&0o077 != 0:
		c.Detail = fmt.Sprintf("%s has mode %04o: group or others may read or write it", path, st.Mode().Perm())
		c.Fix = "chmod 600 " + path
		return c, false
	}
	if uid, ok := owner(st); ok && uid != 0 && uid != e.UID {
		c.Detail = fmt.Sprintf("%s is owned by uid %d, not root or this user (uid %d)", path, uid, e.UID)
		c.Fix = "chown root:root " + path
		return c, false
	}
	return c, true
}

func owner(st fs.FileInfo) (int, bool) {
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		return int(s.Uid), true
	}
	return 0, false
}
