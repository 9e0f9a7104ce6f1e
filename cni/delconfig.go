package cni

// A DEL parses leniently: it must tear down what an ADD set up, whatever
// the configuration has become since.

// ParseDelConfig is ParseConfig for DEL, which takes an unknown key
// (Config.UnknownKey says which) rather than refuse it: a pod set up
// before kvipam refused unknown keys must still be torn down. A DEL
// tears down by owner, so the prevResult is not read.
func ParseDelConfig(data []byte) (*Config, error) { return parseConfig(data, false) }

// ParseIPAMDelConfig is ParseIPAMConfig for DEL: an unknown key under
// "ipam" is taken, and the prevResult not read, as by ParseDelConfig.
func ParseIPAMDelConfig(data []byte) (*Config, error) { return parseIPAMConfig(data, false) }
