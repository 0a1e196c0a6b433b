"""KV handoff: saved slot states streamed from the node that prefilled them to the node that decodes.

Pure cores (no I/O, no clock): `receiver` and `sender` (the two sides of a session as state machines with
their transitions as tables: credits, ordered tiling, per-segment blake3, the commit's counts and payload
digest, deadlines), `cost` (whether a remote prefill plus the transfer beats a local prefill, and from how many
tokens on). The shell on the bus: `actor` (`HandoffActor`: the receiving endpoint and sessions, staging under
`<data_dir>/handoff/`, and `send` for the runner), with `restore` (the hook that hands a committed payload to
the node's L3 store and to whoever restores it into llama-server) and `probe` (link probes). `api` is what the
runner sees (`HandoffAccess`, `HandoffFailed`, `HandoffReport`). Wire format: messages/handoff.py.
"""

from typing import Final

#: The pure cores: no I/O, no clock, no randomness, all of it passed in (`tests/test_import_rules.py` holds
#: them, and everything else, to the import rules of the design).
CORES: Final = frozenset({"receiver", "sender", "cost"})
#: What another actor's shell may import besides the cores: the in-process interface the runner uses.
INTERFACES: Final = frozenset({"api"})
