"""What every actor uses (actor base and supervision, the bus, buckets, the journal, the embedded server,
configuration, logging) and the two places that wire actors together, `launcher` and `cli`, which nothing
imports."""

from __future__ import annotations

from typing import Final

#: The pure modules a core may import: no I/O, no clock, no randomness, all of it passed in
#: (`tests/test_import_rules.py` holds them, and everything else, to the import rules of the design).
CORES: Final = frozenset({"key_limits", "restart", "roles", "sizes", "tickets"})
