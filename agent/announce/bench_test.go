package announce_test

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/announce"
)

// BenchmarkAnnouncementLatency measures, for each implementation, the time
// from the guest's sending of one RARP (a guestannounce.Sender: one
// sendto on a socket of the pod's namespace) to the Announcement received
// on C: ns/op, and the p50 and p99 of the single operations in µs.
// (guestannounce.Send enters the namespace for each frame, which alone
// costs milliseconds here: not the watcher's latency.)
//
//	go test -run '^$' -bench AnnouncementLatency -benchtime 2000x ./agent/announce/
func BenchmarkAnnouncementLatency(b *testing.B) {
	for _, im := range impls {
		b.Run(im.name, func(b *testing.B) {
			e := newEnv(b, im)
			p := e.p1
			p.watch(b, e.w)
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				require.NoError(b, p.sender.Send(announce.RARP, netip.Addr{}, nil))
				next(b, e.w)
				lat = append(lat, time.Since(start))
			}
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
	}
}
