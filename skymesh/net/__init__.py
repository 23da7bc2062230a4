"""HTTP edges shared by the daemons: serving, connection limits, strict JSON bodies,
the URL policy."""
