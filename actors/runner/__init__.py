"""Runner: llama-server instances on this node (`mesh.runner.<node>.*`), supervised, verified and served.

Pure cores: `command` (the command line, every allocating flag pinned), `drift` (settings drift before and after
start), `instance_lifecycle` (the instance state machine), `limits` (deadlines and bounds), `allocation_log`
(llama.cpp's allocation lines), `observed` (the observed footprint), `health` (liveness by inference),
`start_checks` (worker-side admission), `ledger_rules` (what a starting runner releases, what runs unbooked),
`slots` (which slot serves a request), `fairqueue` (which waiting request gets the next slot: class, then fair
share), `passthrough` (what the mesh does around a client's own body), `plan` (one generation's serving plan: what
to restore, when to capture), `chat_shapes` (Messages and Responses bodies as the chat bodies the server renders),
`server_json` (JSON as the server writes it), `parts` (which parts of other nodes' splits this node lends),
`serving_rules` (where a prompt is computed, what a server's failure and a generation's stop mean), `renders` (the
prompts an instance rendered, by the body they came from). Shells: `actor` (endpoints, one driver per instance),
`driver`, `process`, `reaper`, `engine`, `preflight`, `records`, `upkeep`, split serving (`lending` on a member,
`members` on a head), and the serving path (`serving`, `forward`, `captures`, `served`, `stream`, `state_file`,
`server_api`; `served` holds what `forward` and `captures` need of the serving shell, so neither imports `serving`).
"""

from __future__ import annotations

from typing import Final

#: The pure cores: no I/O, no clock, no randomness, all of it passed in (`tests/test_import_rules.py` holds
#: them, and everything else, to the import rules of the design).
CORES: Final = frozenset(
    {
        "command", "drift", "instance_lifecycle", "limits", "allocation_log", "observed", "health", "start_checks",
        "ledger_rules",
        "slots", "fairqueue", "passthrough", "plan", "chat_shapes", "server_json", "parts", "serving_rules", "renders",
    }
)  # fmt: skip
