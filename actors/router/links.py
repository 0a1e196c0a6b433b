"""What a handoff between two nodes costs, as the router has seen it (pure).

A link (`src>dst`) is a line, `seconds = fixed_s + bytes / bytes_per_s` (`actors.handoff.cost.fit_link`),
fitted on the most recent samples of one kind:

* what disaggregated generations reported (`handoff_bytes`, `handoff_ms`: everything the handoff added to
  the generation beyond the remote server's prompt computation, which the cost model counts from the same
  timings: the request to the prefill node, its slot save, the transfer, the target's store commit and the
  restore into the decoding slot). These are the cost the routing decision weighs, so once a pair has any,
  only they count;
* before that, a link probe's handoffs (`link_measured`: the transfer alone, of two sizes), a lower bound.

A link whose prefill failed (the decoding runner computed the prompt itself: `prefill_fallback`) rests for
`REST_S`: it is left out of `links(now)`, so routing does not choose it again meanwhile (each such request would
pay one failed try). What routing was given is journaled with each decision (`generate_routed.links`), so
replay needs nothing of this.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Final

from actors.handoff import cost

__all__ = ["KEEP", "LinkBook"]

#: Samples kept per pair and kind: enough for a fit, few enough to follow a link that changes.
KEEP: Final = 16
#: How long a link whose prefill failed is not chosen (seconds).
REST_S: Final = 60.0


class LinkBook:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._results: dict[str, deque[tuple[float, float]]] = {}
        self._probes: dict[str, tuple[tuple[float, float], ...]] = {}
        self._resting: dict[str, float] = {}  # key -> until when (the caller's clock) it is left out

    def observe_result(self, key: str, n_bytes: float, seconds: float) -> None:
        if n_bytes > 0 and seconds > 0:
            self._results.setdefault(key, deque(maxlen=self._keep)).append((n_bytes, seconds))

    def observe_probe(self, key: str, samples: Sequence[tuple[float, float]]) -> None:
        """A probe's samples replace the previous probe's."""
        kept = tuple((b, t) for b, t in samples if b > 0 and t > 0)[-self._keep :]
        if kept:
            self._probes[key] = kept

    def failed(self, key: str, now: float) -> None:
        """A prefill over `key` failed at `now`: the link rests for `REST_S`."""
        self._resting[key] = now + REST_S

    def links(self, now: float) -> dict[str, cost.Link]:
        """Every link with a fit, but those resting at `now`."""
        self._resting = {key: until for key, until in self._resting.items() if until > now}
        out: dict[str, cost.Link] = {}
        for key in sorted((set(self._results) | set(self._probes)) - set(self._resting)):
            samples = self._results.get(key) or self._probes.get(key, ())
            link = cost.fit_link(list(samples))
            if link is not None:
                out[key] = link
        return out
