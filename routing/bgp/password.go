package bgp

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// maxPasswordLen is the longest TCP MD5 key Linux takes
// (TCP_MD5SIG_MAXKEYLEN).
const maxPasswordLen = 80

// checkPassword says why pw cannot be a TCP MD5 key.
func checkPassword(pw string) error {
	if len(pw) > maxPasswordLen {
		return fmt.Errorf("%d bytes long: TCP MD5 keys are at most %d", len(pw), maxPasswordLen)
	}
	return nil
}

// readPassword reads a peer's TCP MD5 password from file (a Kubernetes
// Secret's key mounted as a file). One trailing newline, which `echo`
// and most editors add, is not part of it; an empty file is refused, as
// a session without the password the router expects never comes up.
func readPassword(file string) (string, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("read: %w", err)
	}
	pw := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if pw == "" {
		return "", errors.New("the file is empty")
	}
	if err := checkPassword(pw); err != nil {
		return "", err
	}
	return pw, nil
}

// resolvePasswords reads each peer's passwordFile into its Password,
// naming the peer of every file it cannot use.
func resolvePasswords(peers []Peer) error {
	var errs []error
	for i := range peers {
		p := &peers[i]
		if p.PasswordFile == "" {
			continue
		}
		pw, err := readPassword(p.PasswordFile)
		if err != nil {
			errs = append(errs, fmt.Errorf("bgp: peer %s: passwordFile %s: %w", p.Address, p.PasswordFile, err))
			continue
		}
		p.Password = pw
	}
	return errors.Join(errs...)
}
