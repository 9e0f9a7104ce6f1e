// Package suggest names the word a misspelt one was probably meant to be,
// for the "did you mean" of every unknown key: the agent's configuration
// file (configfile) and the CNI plugins' configurations (cni). It imports
// nothing of kvipam.
package suggest

import "strings"

// Closest is the name in names that k was probably meant to be: the same
// but for case or the separators of flag and environment names
// (lease-ttl, LEASE_TTL for leaseTTL), else within a small edit distance
// (one edit in five letters, at least one); "" if none is.
func Closest(k string, names []string) string {
	best, bestD := "", -1
	nk := normalize(k)
	for _, n := range names {
		d := editDistance(nk, normalize(n))
		if d <= 1+len(nk)/5 && (bestD < 0 || d < bestD) {
			best, bestD = n, d
		}
	}
	return best
}

// Same reports whether a and b are the same name but for case and
// separators.
func Same(a, b string) bool { return normalize(a) == normalize(b) }

func normalize(k string) string {
	return strings.ToLower(strings.NewReplacer("-", "", "_", "").Replace(k))
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
