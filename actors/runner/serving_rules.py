"""What the serving path decides around a generation, besides its plan (runner core, pure).

`plan.ServingPlan` decides what to restore and when to capture; this module decides the rest, for both ways a
request is served (`serving`: the mesh's own `mesh.generate`; `forward`: a client's body passed through):

* **Where the prompt is computed** (`prefill_route`): on the node the router named (`prefill_node`), handed off
  here, when that node is another and the slot does not already hold all but the last token; not for a request
  of a cache scope (its state would land in this node's store under no scope of its own).
* **What a failed remote prefill means** (`prefill_fallback`): the prompt is computed here instead, unless the
  request's own time is spent (`timeout`): then nobody waits for an answer computed now.
* **What a server's failure means** (`server_failure`): whether it counts against the instance's health (no
  answer at all, or a 5xx other than a full context: the server failed, not the request) and the request's error
  code (`bad_request` for the server's 400, else `unavailable`).
* **Why a generation stopped** (`stop_reason`): the requester left (`cancelled`), else the server's stop type.

No I/O, no clock: what the shells saw is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from messages.errors import BAD_REQUEST, TIMEOUT, UNAVAILABLE
from messages.generate import StopReason

__all__ = ["Failure", "PrefillRoute", "prefill_fallback", "prefill_route", "server_failure", "stop_reason"]

#: A server's error that is the request's own doing, not the server's failure (its answer was a 500 all the same).
_REQUEST_ERRORS: Final = ("context size has been exceeded",)
_STOP_TYPES: Final[dict[str, StopReason]] = {"eos": "eos", "word": "stop_word"}


@dataclass(frozen=True)
class PrefillRoute:
    """Where a request's prompt is computed: on `node` (None: here), and why not where the router said."""

    node: str | None
    skipped: str = ""


def prefill_route(
    prefill_node: str | None, this_node: str, *, resident: int, n_tokens: int, cache_scope: str
) -> PrefillRoute:
    """`prefill_node` (the router's choice) when it is another node and the slot lacks more than the last token."""
    if prefill_node in (None, this_node) or resident >= n_tokens - 1:
        return PrefillRoute(None)
    if cache_scope:
        return PrefillRoute(None, f"prefill on {prefill_node} skipped: a scoped request's prompt is computed here")
    return PrefillRoute(prefill_node)


def prefill_fallback(node: str, code: str) -> str | None:
    """Why the prompt is computed here after the prefill on `node` failed with `code`; None: the request fails."""
    if code == TIMEOUT:
        return None
    return f"prefill on {node} failed ({code}): computed here"


@dataclass(frozen=True)
class Failure:
    """What a server's failure means: whether it counts against the instance's health, and the request's code."""

    counts: bool
    code: str


def server_failure(status: int | None, message: str) -> Failure:
    """A request to the server failed with `status` (None or 0: no answer at all) and `message`."""
    request_error = any(text in message.lower() for text in _REQUEST_ERRORS)
    counts = (not status or status >= 500) and not request_error
    return Failure(counts=counts, code=BAD_REQUEST if status == 400 else UNAVAILABLE)


def stop_reason(stop_type: object, *, cancelled: bool) -> StopReason:
    """Why a generation stopped: its requester left, or the server's `stop_type` (anything else: its limit)."""
    if cancelled:
        return "cancelled"
    return _STOP_TYPES.get(str(stop_type), "limit")
