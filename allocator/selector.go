package allocator

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// ErrInvalidSelector is returned by ParseSelector and ParseLabels; the
// message names the term at fault.
var ErrInvalidSelector = errors.New("allocator: invalid node selector")

// Selector chooses nodes by their labels, in the spelling of Kubernetes'
// equality-based label selectors: comma-separated terms, each `k=v` (or
// `k==v`), `k!=v`, `k` (the label exists) or `!k` (it does not). A node
// matches when every term holds; the empty selector matches every node.
// It is a plain value, safe for concurrent use.
type Selector struct {
	terms []selTerm
}

type selOp int

const (
	opEq selOp = iota
	opNotEq
	opExists
	opNotExists
)

type selTerm struct {
	op         selOp
	key, value string
}

// ParseSelector reads a selector as an operator writes it ("rack=r1",
// "zone=a,gpu", "!spot"). Spaces around terms are ignored.
func ParseSelector(s string) (Selector, error) {
	var sel Selector
	if strings.TrimSpace(s) == "" {
		return sel, nil
	}
	for raw := range strings.SplitSeq(s, ",") {
		t := strings.TrimSpace(raw)
		var term selTerm
		switch {
		case strings.Contains(t, "!="):
			k, v, _ := strings.Cut(t, "!=")
			term = selTerm{op: opNotEq, key: strings.TrimSpace(k), value: strings.TrimSpace(v)}
		case strings.Contains(t, "=="):
			k, v, _ := strings.Cut(t, "==")
			term = selTerm{op: opEq, key: strings.TrimSpace(k), value: strings.TrimSpace(v)}
		case strings.Contains(t, "="):
			k, v, _ := strings.Cut(t, "=")
			term = selTerm{op: opEq, key: strings.TrimSpace(k), value: strings.TrimSpace(v)}
		case strings.HasPrefix(t, "!"):
			term = selTerm{op: opNotExists, key: strings.TrimSpace(t[1:])}
		default:
			term = selTerm{op: opExists, key: t}
		}
		if err := validLabelKey(term.key); err != nil {
			return Selector{}, fmt.Errorf("%w: term %q: %w", ErrInvalidSelector, t, err)
		}
		if err := validLabelValue(term.value); err != nil {
			return Selector{}, fmt.Errorf("%w: term %q: %w", ErrInvalidSelector, t, err)
		}
		sel.terms = append(sel.terms, term)
	}
	return sel, nil
}

// Empty reports whether s matches every node.
func (s Selector) Empty() bool { return len(s.terms) == 0 }

// Matches reports whether a node with labels is chosen by s.
func (s Selector) Matches(labels map[string]string) bool {
	for _, t := range s.terms {
		v, ok := labels[t.key]
		switch t.op {
		case opEq:
			if !ok || v != t.value {
				return false
			}
		case opNotEq:
			// As in Kubernetes: a node without the label is not equal.
			if ok && v == t.value {
				return false
			}
		case opExists:
			if !ok {
				return false
			}
		case opNotExists:
			if ok {
				return false
			}
		}
	}
	return true
}

// String writes s as ParseSelector reads it.
func (s Selector) String() string {
	parts := make([]string, len(s.terms))
	for i, t := range s.terms {
		switch t.op {
		case opEq:
			parts[i] = t.key + "=" + t.value
		case opNotEq:
			parts[i] = t.key + "!=" + t.value
		case opExists:
			parts[i] = t.key
		case opNotExists:
			parts[i] = "!" + t.key
		}
	}
	return strings.Join(parts, ",")
}

// Selects reports whether the pool gives new blocks and addresses to a
// node with labels. A selector that does not parse (Validate refuses it)
// selects no node.
func (p Pool) Selects(labels map[string]string) bool {
	sel, err := ParseSelector(p.NodeSelector)
	return err == nil && sel.Matches(labels)
}

// ParseLabels reads node labels as given to the agent's --node-labels:
// comma-separated k=v pairs ("rack=r1,zone=a").
func ParseLabels(s string) (map[string]string, error) {
	out := map[string]string{}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	for raw := range strings.SplitSeq(s, ",") {
		t := strings.TrimSpace(raw)
		k, v, ok := strings.Cut(t, "=")
		if !ok {
			return nil, fmt.Errorf("%w: label %q is not key=value", ErrInvalidSelector, t)
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if err := CheckLabels(map[string]string{k: v}); err != nil {
			return nil, err
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("%w: label %q given twice", ErrInvalidSelector, k)
		}
		out[k] = v
	}
	return out, nil
}

// CheckLabels reports the first label whose key or value a selector
// could not name.
func CheckLabels(labels map[string]string) error {
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		if err := validLabelKey(k); err != nil {
			return fmt.Errorf("%w: label %q: %w", ErrInvalidSelector, k, err)
		}
		if err := validLabelValue(labels[k]); err != nil {
			return fmt.Errorf("%w: label %q: %w", ErrInvalidSelector, k, err)
		}
	}
	return nil
}

// FormatLabels writes labels as ParseLabels reads them, sorted by key.
func FormatLabels(labels map[string]string) string {
	parts := make([]string, 0, len(labels))
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		parts = append(parts, k+"="+labels[k])
	}
	return strings.Join(parts, ",")
}

// validLabelKey accepts Kubernetes label keys: an optional DNS prefix and
// a slash, then a name of letters, digits, '-', '_' and '.'.
func validLabelKey(k string) error {
	if k == "" {
		return errors.New("empty label key")
	}
	if len(k) > 316 {
		return errors.New("label key longer than 316 characters")
	}
	prefix, name, ok := strings.Cut(k, "/")
	if !ok {
		name, prefix = prefix, ""
	} else if prefix == "" || strings.Trim(prefix, "abcdefghijklmnopqrstuvwxyz0123456789-.") != "" {
		return fmt.Errorf("label key prefix %q is not a DNS subdomain", prefix)
	}
	if name == "" {
		return fmt.Errorf("label key %q has an empty name", k)
	}
	return validLabelValue(name)
}

// validLabelValue accepts letters, digits, '-', '_' and '.', at most 63,
// starting and ending with a letter or digit; empty is allowed.
func validLabelValue(v string) error {
	if v == "" {
		return nil
	}
	if len(v) > 63 {
		return fmt.Errorf("%q is longer than 63 characters", v)
	}
	alnum := func(r byte) bool { return 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' }
	for i := 0; i < len(v); i++ {
		if c := v[i]; !alnum(c) && c != '-' && c != '_' && c != '.' {
			return fmt.Errorf("%q has character %q; only letters, digits, '-', '_' and '.' are allowed", v, c)
		}
	}
	if !alnum(v[0]) || !alnum(v[len(v)-1]) {
		return fmt.Errorf("%q must start and end with a letter or digit", v)
	}
	return nil
}
