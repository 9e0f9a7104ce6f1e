// Package prometheus_test checks kvipam's Prometheus rules: promtool
// validates kvipam-rules.yaml and runs its unit tests, and the rules'
// content is held to what an on-call reader needs.
package prometheus_test

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// Paths are relative to this package's directory, go test's working
// directory.
const (
	rulesFile = "kvipam-rules.yaml"
	testsFile = "kvipam-rules.test.yaml"
)

// wantAlerts are the alerts the rules must define, with their severity.
var wantAlerts = map[string]string{
	"KvipamPoolNearlyFull":   "warning",
	"KvipamPoolFull":         "critical",
	"KvipamOrphanedBlocks":   "warning",
	"KvipamNodeLeaseLost":    "critical",
	"KvipamNodeNameConflict": "critical",
	"KvipamLeakCandidates":   "warning",
	"KvipamBGPPeerDown":      "critical",
}

const fullnessRecord = "kvipam:pool_fullness:ratio"

type ruleFile struct {
	Groups []struct {
		Name  string `json:"name"`
		Rules []struct {
			Record      string            `json:"record"`
			Alert       string            `json:"alert"`
			Expr        string            `json:"expr"`
			For         string            `json:"for"`
			Labels      map[string]string `json:"labels"`
			Annotations map[string]string `json:"annotations"`
		} `json:"rules"`
	} `json:"groups"`
}

type testFile struct {
	Tests []struct {
		Name          string `json:"name"`
		AlertRuleTest []struct {
			Alertname string `json:"alertname"`
			ExpAlerts []any  `json:"exp_alerts"`
		} `json:"alert_rule_test"`
		PromqlExprTest []struct {
			Expr string `json:"expr"`
		} `json:"promql_expr_test"`
	} `json:"tests"`
}

func TestAlertRules(t *testing.T) {
	t.Run("content", func(t *testing.T) {
		var rf ruleFile
		readYAML(t, rulesFile, &rf)
		seen := map[string]bool{}
		for _, g := range rf.Groups {
			for _, r := range g.Rules {
				if r.Record != "" {
					seen[r.Record] = true
					continue
				}
				name := r.Alert
				if seen[name] {
					t.Errorf("alert %s defined twice", name)
				}
				seen[name] = true
				sev := r.Labels["severity"]
				if sev == "" {
					t.Errorf("alert %s has no severity label", name)
				} else if want, ok := wantAlerts[name]; ok && sev != want {
					t.Errorf("alert %s has severity %q, want %q", name, sev, want)
				}
				for _, a := range []string{"summary", "description"} {
					if strings.TrimSpace(r.Annotations[a]) == "" {
						t.Errorf("alert %s has no %s annotation", name, a)
					}
				}
			}
		}
		for name := range wantAlerts {
			if !seen[name] {
				t.Errorf("alert %s is missing from %s", name, rulesFile)
			}
		}
		if !seen[fullnessRecord] {
			t.Errorf("recording rule %s is missing from %s", fullnessRecord, rulesFile)
		}

		// Every alert has a case where it fires and one where it does
		// not; the recording rule has an expression test.
		var tf testFile
		readYAML(t, testsFile, &tf)
		fires, silent := map[string]bool{}, map[string]bool{}
		recordTested := false
		for _, c := range tf.Tests {
			for _, a := range c.AlertRuleTest {
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname] = true
				} else {
					silent[a.Alertname] = true
				}
			}
			for _, e := range c.PromqlExprTest {
				recordTested = recordTested || strings.Contains(e.Expr, fullnessRecord)
			}
		}
		for name := range wantAlerts {
			if !fires[name] {
				t.Errorf("%s has no case where %s fires", testsFile, name)
			}
			if !silent[name] {
				t.Errorf("%s has no case where %s does not fire", testsFile, name)
			}
		}
		if !recordTested {
			t.Errorf("%s has no promql_expr_test of %s", testsFile, fullnessRecord)
		}
	})

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		const why = "promtool not on PATH; install Debian's prometheus package (apt-get install prometheus)"
		if os.Geteuid() == 0 {
			t.Fatal(why)
		}
		t.Skip(why)
	}
	t.Run("series exported", func(t *testing.T) {
		// Every kvipam series a rule reads is one the agent defines, so
		// no alert silently sees no data.
		rules, err := os.ReadFile(rulesFile)
		if err != nil {
			t.Fatal(err)
		}
		var src strings.Builder
		for _, f := range []string{"../../agent/metrics.go", "../../agent/poolmetrics.go", "../../routing/bgp/metrics.go"} {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			src.Write(b)
		}
		for _, name := range regexp.MustCompile(`\bkvipam_[a-z_]+`).FindAllString(string(rules), -1) {
			if !strings.Contains(src.String(), `"`+name+`"`) {
				t.Errorf("the rules read %s, which the agent does not export", name)
			}
		}
	})
	t.Run("check", func(t *testing.T) { runPromtool(t, promtool, "check", "rules", rulesFile) })
	t.Run("test", func(t *testing.T) { runPromtool(t, promtool, "test", "rules", testsFile) })
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, v); err != nil {
		t.Fatalf("parse %s: %v", path, err)
	}
}

func runPromtool(t *testing.T, promtool string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, promtool, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("promtool %s:\n%s", strings.Join(args, " "), out)
}
