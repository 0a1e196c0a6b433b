"""Front door: the HTTP server of OpenAI's and Anthropic's APIs over `mesh.generate`, with models on demand.
Pure cores `catalog` (models.toml), `keys` (tenants' API keys and their scopes), `lifecycle` (what to stop to
make room, what idles out), `limits` (per-key rate buckets and concurrency), `scaling` (when to add or retire
a replica) and `shapes` (the HTTP surface: paths, keys, error shapes, the model renamed in answers); the shells:
`actor` serves HTTP, `relay` carries an answer back to its client, `ondemand` starts and stops models (the
actor's other half), `replicas` carries out the scaling of the catalog's models,
`limits_shared` keeps the per-key limits in a bucket every front door shares, `accounting` admits, settles and
journals each request."""

from typing import Final

#: The pure cores (`tests/test_import_rules.py` holds them, and everything else, to the design's import rules).
CORES: Final = frozenset({"catalog", "keys", "lifecycle", "limits", "scaling", "shapes"})
