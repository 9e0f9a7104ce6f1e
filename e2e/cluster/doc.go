// Package cluster runs a real etcd cluster for tests: n members (3 by
// default) as separate OS processes on loopback, with mutual TLS on the
// client and peer URLs, so a test can SIGKILL, SIGSTOP/SIGCONT and restart
// any member, the leader included, and watch the cluster and its clients
// deal with it. The in-process kvstore/etcdtest cannot do that: a member
// that shares the test's process cannot be killed or frozen alone.
//
// The etcd binary is built once per test process from ./etcd, a main
// that calls etcdmain, so its version is this module's go.mod and nothing
// is downloaded. Start builds it, issues a CA, member certificates and
// client certificates (the CN is the etcd user name), picks free loopback
// ports, starts the members and waits until they agree on a leader.
// Every member is killed and reaped by t.Cleanup, also when the test fails;
// on Linux a member also dies with the test binary (Pdeathsig).
//
// Each member writes its log (level warn) to <name>.log in the test's
// artifact directory (go test -artifacts keeps it; otherwise it is a
// temporary directory). When the test fails, the cleanup prints the path
// and the last lines of every log.
//
// A package whose tests use Start should remove the built binary when its
// tests end:
//
//	func TestMain(m *testing.M) {
//		code := m.Run()
//		cluster.RemoveBinaries()
//		os.Exit(code)
//	}
//
// The timers (heartbeat 50 ms, election 500 ms by default) and
// --unsafe-no-fsync are for tests only, never for production.
package cluster
