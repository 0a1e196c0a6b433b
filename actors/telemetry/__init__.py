"""Telemetry: each node's memory, devices and serving settings, published every few seconds and on change.

Pure core: `resources` (building the `NodeResources` report; when to send early, when to journal). Shells:
`probes` (host RAM, cgroup v2, NVML), `actor` (publishing, the nodes-bucket put with a TTL).
"""

from __future__ import annotations

from typing import Final

#: The pure cores: no I/O, no clock, no randomness, all of it passed in (`tests/test_import_rules.py` holds
#: them, and everything else, to the import rules of the design).
CORES: Final = frozenset({"resources"})
