package main

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/rblk/rblk/initiator/kernel"
)

func TestDeviceFlagsCheck(t *testing.T) {
	for _, c := range []struct {
		d         deviceFlags
		nbdListen string
		want      string
	}{
		{deviceFlags{timeout: kernel.DefaultTimeout}, "", "--nbd-listen unix:PATH|tcp:HOST:PORT or --device /dev/nbdN|auto is required"},
		{deviceFlags{device: "auto", timeout: kernel.DefaultTimeout}, "unix:/x", "--nbd-listen and --device exclude each other"},
		{deviceFlags{connections: 2, timeout: kernel.DefaultTimeout}, "unix:/x", "--connections, --request-timeout, --dead-conn-timeout and --adopt go with --device"},
		{deviceFlags{timeout: time.Second}, "unix:/x", "--connections, --request-timeout, --dead-conn-timeout and --adopt go with --device"},
		{deviceFlags{device: "auto", connections: -1, timeout: kernel.DefaultTimeout}, "", "--connections: want 0 (automatic) or more"},
		{deviceFlags{device: "/dev/sda", timeout: kernel.DefaultTimeout}, "", "--device: device \"/dev/sda\": want /dev/nbdN or auto"},
		{deviceFlags{timeout: kernel.DefaultTimeout}, "unix:/x", ""},
		{deviceFlags{device: "ublk", timeout: time.Second}, "", "--request-timeout goes with NBD devices: ublk requests wait as long as the volume's IO (--io-timeout, --reconnect-timeout)"},
		{deviceFlags{timeout: kernel.DefaultTimeout, adopt: true}, "unix:/x", "--connections, --request-timeout, --dead-conn-timeout and --adopt go with --device"},
		{deviceFlags{device: "auto", timeout: kernel.DefaultTimeout, deadConnTimeout: -time.Second}, "", "--dead-conn-timeout: want 0 (none) or more"},
		{deviceFlags{device: "auto", timeout: kernel.DefaultTimeout, adopt: true}, "", "--adopt needs the device to adopt, /dev/nbdN"},
		{deviceFlags{device: "ublk", timeout: kernel.DefaultTimeout, adopt: true}, "", "--adopt needs the device to adopt, /dev/nbdN"},
		{deviceFlags{device: "ublk", timeout: kernel.DefaultTimeout, deadConnTimeout: time.Minute}, "", "--dead-conn-timeout goes with NBD devices"},
		{deviceFlags{device: "/dev/nbd0", timeout: kernel.DefaultTimeout, adopt: true, connections: 2}, "", "--adopt takes the device's own number of connections: leave out --connections"},
		{deviceFlags{device: "/dev/ublkc0", timeout: kernel.DefaultTimeout}, "", "--device: device \"/dev/ublkc0\": want /dev/nbdN or auto"},
	} {
		err := c.d.check(c.nbdListen)
		got := ""
		if err != nil {
			got = err.Error()
		}
		if got != c.want {
			t.Errorf("%+v with --nbd-listen %q: %q, want %q", c.d, c.nbdListen, got, c.want)
		}
		if strings.Contains(got, "\n") {
			t.Errorf("error of more than one line: %q", got)
		}
	}
}

func TestAlive(t *testing.T) {
	if !alive(os.Getpid()) {
		t.Error("this process is not alive")
	}
	if alive(1 << 30) {
		t.Error("a pid that cannot exist is alive")
	}
}
