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
* **Why a generation stopped** (`stop_reason`, `relay_stop`): the requester left (`cancelled`), else the server's
  stop type (a relayed answer's own last word on it).
* **What a generation's answer leaves** (`generation_answer`, `relay_completed`): whether the plan may keep what
  the slot holds (an answer the requester stayed for; a relayed one also a 200), how many tokens the server
  generated, and whether the runner got every generated token's id (then the slot holds them too).
* **What a requester that left is charged** (`relay_charge`): what the server did all the same: the prompt as
  rendered here when the answer never said, and the tokens the slot had decoded.
* **The times the server's own clock gives** (`first_token_s`: its prompt time and one token's, for an answer
  that came whole) and **what a handoff added** (`handoff_ms`: beyond the remote server's prompt computation).

No I/O, no clock: what the shells saw is passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from actors.runner.passthrough import AnswerTokens, answer_stop
from messages.errors import BAD_REQUEST, TIMEOUT, UNAVAILABLE
from messages.generate import StopReason

__all__ = [
    "Failure", "GenerationAnswer", "PrefillRoute", "first_token_s", "generation_answer", "handoff_ms",
    "prefill_fallback", "prefill_route", "relay_charge", "relay_completed", "relay_stop", "server_failure",
    "stop_reason",
]  # fmt: skip

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


def relay_stop(answers: Sequence[Any], *, cancelled: bool) -> StopReason:
    """Why a relayed answer's generation stopped: its requester left, or the answer's own last word on it."""
    return "cancelled" if cancelled else answer_stop(answers)


def relay_completed(status: int, *, cancelled: bool) -> bool:
    """Whether a relayed answer is one the plan may keep what the slot holds after: a 200 the requester stayed for."""
    return status == 200 and not cancelled


def relay_charge(counts: AnswerTokens, *, cancelled: bool, prompt_tokens: int, decoded: int) -> AnswerTokens:
    """The counts a relayed answer is charged: as it said them, unless its requester left: then the prompt as
    rendered here (when the answer never said) and at least the tokens the slot had decoded."""
    if not cancelled:
        return counts
    return dataclasses.replace(counts, prompt=counts.prompt or prompt_tokens, generated=max(counts.generated, decoded))


@dataclass(frozen=True)
class GenerationAnswer:
    """What the mesh's own completion left: why it stopped, how many tokens the server generated, and whether the
    runner got every generated token's id (`exact`)."""

    stop: StopReason
    generated: int
    exact: bool

    @property
    def completed(self) -> bool:
        """The requester stayed for the answer: the plan may keep what the slot holds."""
        return self.stop != "cancelled"

    @property
    def ids_known(self) -> bool:
        """The slot holds the prompt and every generated token but the last, and the runner knows their ids."""
        return self.exact and self.completed


def generation_answer(final: Mapping[str, Any], n_ids: int, *, cancelled: bool) -> GenerationAnswer:
    """A completion's last answer (`final`: its `tokens_predicted` and `stop_type`) when the runner received
    `n_ids` generated token ids and the requester did or did not leave."""
    predicted = final.get("tokens_predicted", n_ids)
    return GenerationAnswer(
        stop=stop_reason(final.get("stop_type"), cancelled=cancelled),
        generated=int(predicted or n_ids),
        exact=int(predicted or 0) == n_ids,
    )


def first_token_s(timings: Mapping[str, Any]) -> float:
    """Seconds from the request to its first token by the server's own clock: the prompt's time, then one
    token's (what is missing or not a time counts nothing)."""
    return (_ms(timings.get("prompt_ms")) + _ms(timings.get("predicted_per_token_ms"))) / 1000


def handoff_ms(elapsed_ms: float, *, compute_ms: float, prefill_ms: float, last_token_ms: float) -> float:
    """What a handoff added beyond the remote server's prompt computation (`compute_ms`, else the whole remote
    `prefill_ms`): of `elapsed_ms` from the ask to the restored slot, the requests between, the remote slot save,
    the transfer, this store's commit and the restore, plus the prompt's last token computed here
    (`last_token_ms`, a decode step of its own). What the cost model weighs."""
    return max(0.0, elapsed_ms - (compute_ms or prefill_ms) + last_token_ms)


def _ms(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else 0.0
