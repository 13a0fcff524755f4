// Package faultnet wraps a transport.Provider to inject faults in tests, in
// the manner of etcd's rafttest network: every Conn it makes is a *Conn that
// a test can Disconnect (pull the cable) or whose completions it can Delay.
//
//	fn := faultnet.Wrap(tcp.New("tcp"))
//	// ... dial and accept through fn ...
//	fn.Conns()[0].Delay(50 * time.Millisecond)
//	fn.DisconnectAll()
package faultnet
