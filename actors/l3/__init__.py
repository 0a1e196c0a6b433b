"""L3: a durable, content-addressed store of saved llama-server slot states (KV and recurrent state).

Pure cores (no I/O, no clock): `identity` (which states are interchangeable), `layout` (digests, segment
plan, manifest format, where things live), `commit` (the rules a manifest must satisfy before it exists),
`budget` (which entries and segments one eviction pass removes), `prefix` (the longest stored prefix of a
prompt, by hashing the prompt's own tokens at the recorded lengths), `entry_index` (what a node holds and what
its peers publish). Blocking shells, meant for worker threads: `files` (durable-file primitives), `store`
(ingest, assemble and verify, reconcile, budget), `store_fetch` (the store's side of peer fetch: serving
chunks, committing a fetched entry). The actor on the bus: `actor` (`L3Actor`: lifecycle, capture,
materialize, inventory), with `keeper` (the one writer of the store and its entry index), `peer` (fetching an
entry from a peer) and `serve` (the endpoints for peers and `mesh-actor l3`). `api` is what the runner sees.
"""

from typing import Final

#: The pure cores: no I/O, no clock, no randomness, all of it passed in (`tests/test_import_rules.py` holds
#: them, and everything else, to the import rules of the design).
CORES: Final = frozenset({"identity", "layout", "commit", "budget", "prefix", "entry_index"})
#: What another actor's shell may import besides the cores: the in-process interface the runner and the
#: handoff actor use.
INTERFACES: Final = frozenset({"api"})
