"""Metrics: each node's Prometheus metrics (`GET /metrics` on the front door's listener, or on `--metrics`).
Pure cores: `families` (every family the node exports: its name, type, meaning, labels and buckets), `fold`
(what the journal's events, the buckets' records and the runner's serving reports say, folded into those
families' values), `engine` (each instance's own llama-server metrics, relabelled with its node, model and
instance). The shell `actor` subscribes to this node's events and serving reports, watches this node's keys of
the buckets, scrapes its instances' llama-servers when it is scraped, and serves the metrics-only listener.
"""

from typing import Final

#: The pure cores (`tests/test_import_rules.py` holds them, and everything else, to the design's import rules).
CORES: Final = frozenset({"families", "fold", "engine"})
