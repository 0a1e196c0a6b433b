"""Front door: the HTTP server of OpenAI's and Anthropic's APIs over `mesh.generate`, with models on demand.
Pure cores `catalog` (models.toml), `keys` (tenants' API keys and their scopes), `ondemand_rules` (what to stop to
make room, what idles out), `scaling` (when to add or retire
a replica) and `shapes` (the HTTP surface: paths, keys, error shapes, the model renamed in answers); the shells:
`actor` serves HTTP, `relay` carries an answer back to its client, `ondemand` starts and stops models (a part
the actor holds, `FrontDoorActor.demand`), `replicas` carries out the scaling of the catalog's models,
`accounting` admits, settles and journals each request against the per-key limits every front door (and
router) shares (`runtime.key_limits`, pure; `runtime.shared_limits`, their bucket)."""

from typing import Final

#: The pure cores (`tests/test_import_rules.py` holds them, and everything else, to the design's import rules).
CORES: Final = frozenset({"catalog", "keys", "ondemand_rules", "scaling", "shapes"})
