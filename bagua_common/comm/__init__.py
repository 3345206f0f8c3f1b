"""Communication: the collectives' contract, the native engines, timeouts, topology and bucket plans."""
