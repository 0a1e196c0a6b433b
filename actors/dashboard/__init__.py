"""Dashboard: the fleet in a browser (`GET /ui` on the front door's listener, under the node's API key).
Pure cores: `view` (the buckets' records and the journal's events folded into what the page shows, and the
deltas each change makes), `explain` (a placement or routing decision with its inputs, re-decided by today's
cores) and `access` (the session cookie a browser holds instead of the key). The shell `actor` watches the
buckets and the journal, and serves the page, its files (`static/`) and the server-sent events that keep it
current.
"""

from typing import Final

#: The pure cores (`tests/test_import_rules.py` holds them, and everything else, to the design's import rules).
CORES: Final = frozenset({"view", "explain", "access"})
