package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
)

// refuseUnknownSubcommands gives every command group under root (pool,
// node, ...) a RunE that refuses an argument it does not know as a
// subcommand. Cobra refuses one only at the root; a group without a Run
// of its own prints its help and succeeds, so `kvipamctl pool delte`
// would look done. A group run alone still prints its help.
func refuseUnknownSubcommands(root *cobra.Command) {
	for _, c := range root.Commands() {
		if !c.HasSubCommands() {
			continue
		}
		refuseUnknownSubcommands(c)
		if c.Run != nil || c.RunE != nil {
			continue
		}
		c.Args = cobra.ArbitraryArgs
		if c.SuggestionsMinimumDistance <= 0 {
			c.SuggestionsMinimumDistance = 2 // cobra's default, set only where it suggests itself
		}
		c.RunE = func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cmd.Help()
			}
			msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
			if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
				msg += fmt.Sprintf(": did you mean %q?", s[0])
			}
			return fmt.Errorf("%s (see %s --help)", msg, strings.TrimSpace(cmd.CommandPath()))
		}
	}
}
