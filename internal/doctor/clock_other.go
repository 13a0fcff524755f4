//go:build !linux

package doctor

import "errors"

func adjtimexClock() (bool, string, error) {
	return false, "", errors.New("adjtimex: Linux only")
}
