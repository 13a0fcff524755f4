package doctor

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// adjtimexClock asks the kernel whether an NTP daemon keeps the clock
// synchronized (STA_UNSYNC cleared, as timedatectl shows it).
func adjtimexClock() (bool, string, error) {
	var tx unix.Timex
	state, err := unix.Adjtimex(&tx)
	if err != nil {
		return false, "", fmt.Errorf("adjtimex: %w", err)
	}
	maxErr := time.Duration(tx.Maxerror) * time.Microsecond
	if tx.Status&unix.STA_UNSYNC != 0 || state == unix.TIME_ERROR {
		return false, fmt.Sprintf("not synchronized (adjtimex: STA_UNSYNC; maximum error %v)", maxErr), nil
	}
	return true, fmt.Sprintf("synchronized (maximum error %v)", maxErr), nil
}
