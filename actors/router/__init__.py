"""Router: `mesh.generate` on every node. Pure cores `prefixes` (which instance holds how much of a prompt),
`routing` (which instance to use, and where to prefill) and `links` (what each node pair's handoffs cost);
the shell `actor` keeps the views and forwards to the chosen runner."""

from typing import Final

#: The pure cores: no I/O, no clock, no randomness, all of it passed in (`tests/test_import_rules.py` holds
#: them, and everything else, to the import rules of the design).
CORES: Final = frozenset({"prefixes", "routing", "links"})
