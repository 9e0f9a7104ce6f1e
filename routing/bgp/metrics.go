package bgp

import (
	"context"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

var (
	descPeerUp = prometheus.NewDesc("kvipam_bgp_peer_up",
		"1 while the BGP session with the peer is established, else 0.", []string{"peer", "peer_asn"}, nil)
	descAdvertised = prometheus.NewDesc("kvipam_bgp_peer_advertised_prefixes",
		"Prefixes sent to the peer, per family.", []string{"peer", "family"}, nil)
	descDownReason = prometheus.NewDesc("kvipam_bgp_peer_down_reason",
		"1 for why the BGP session with the peer is not established: the connect error's kind or the NOTIFICATION sent or received (code / subcode); absent while it is.",
		[]string{"peer", "reason"}, nil)
	descAnnounced = prometheus.NewDesc("kvipam_bgp_announced_prefixes",
		"Prefixes this node announces (its blocks and borrowed addresses), per family.", []string{"family"}, nil)
)

// Collector reads the speaker's state at each scrape.
func (s *Speaker) Collector() prometheus.Collector { return collector{s} }

type collector struct{ s *Speaker }

func (collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descPeerUp
	ch <- descAdvertised
	ch <- descDownReason
	ch <- descAnnounced
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	st := c.s.Status(ctx)
	for f, n := range st.Announced {
		ch <- prometheus.MustNewConstMetric(descAnnounced, prometheus.GaugeValue, float64(n), f)
	}
	for _, p := range st.Peers {
		up := 0.0
		if p.State == "established" {
			up = 1
		}
		ch <- prometheus.MustNewConstMetric(descPeerUp, prometheus.GaugeValue, up, p.Address, itoa(p.ASN))
		if p.ReasonClass != "" {
			ch <- prometheus.MustNewConstMetric(descDownReason, prometheus.GaugeValue, 1, p.Address, p.ReasonClass)
		}
		for f, n := range p.Advertised {
			ch <- prometheus.MustNewConstMetric(descAdvertised, prometheus.GaugeValue, float64(n), p.Address, f)
		}
	}
}

func itoa(v uint32) string { return strconv.FormatUint(uint64(v), 10) }
