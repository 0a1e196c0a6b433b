"""What the runner's request paths share (runner shell): the served instance, the serving limits, the one
oversize refusal, the one reading of a server's failure, and the narrow faces of the serving shell they are
handed.

`serving.Serving` owns the instances and their slots; the paths that serve one request on them (`captures`:
a serving plan's steps on the slot, `forward`: the pass-through) depend on this module, never on `serving`:
what they need of the shell is `SlotHost` (a slot's acquisition, state files and hand-back) and, for the
pass-through, `ServingShell` (the server's API, the bus, the journal and health by inference besides).
`Serving` is their one implementation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from actors.handoff import cost
from actors.l3.api import L3Access, L3Hit
from actors.runner import serving_rules as rules
from actors.runner.fairqueue import Claim
from actors.runner.passthrough import AskLimits
from actors.runner.renders import RenderMemo
from actors.runner.server_api import ServerApi
from actors.runner.slots import ANYONE, Grant, PromptLimit, SlotTable, oversize
from messages.errors import BAD_REQUEST
from runtime.actor import RequestError
from runtime.bus import Bus

__all__ = ["ServedInstance", "ServingLimits", "ServingShell", "SlotHost", "refuse_oversize", "server_failed"]


@dataclass(frozen=True)
class ServingLimits:
    capture_min_tokens: int = 256  # shorter prompts are not kept in L3
    tokenize_timeout_s: float = 10.0
    slot_file_timeout_s: float = 120.0  # one save or restore of a slot state (a large state is seconds of disk)
    idle_timeout_s: float = 120.0  # the server sent nothing this long during a completion (a long prefill)
    max_generations: int = 64  # generations running or queued on this runner at once
    report_interval_s: float = 2.0
    report_ttl_s: float = 10.0
    stream_silence_s: float = 5.0  # a streaming client that answers no ping this long is gone
    asks: AskLimits = field(default_factory=AskLimits)  # what a pass-through may ask (`passthrough`)


def refuse_oversize(
    limit: PromptLimit, *, text: str | None = None, tokens: int | None = None, text_bytes: int | None = None
) -> None:
    """A prompt its slot can never hold (its token ids, its text, or its text's size) is a client error before
    any work (`slots.oversize`)."""
    refused = oversize(limit, text=text, tokens=tokens, text_bytes=text_bytes)
    if refused is not None:
        raise RequestError(BAD_REQUEST, *refused)


def server_failed(
    outcome: Callable[[str, bool, str], None], instance: ServedInstance, error: Exception, status: int | None
) -> RequestError:
    """The request's error (to raise) for a request to the instance's server that failed with `status` (None or 0:
    no answer), told to health by inference (`outcome`) when it counts against the instance
    (`serving_rules.server_failure`)."""
    failure = rules.server_failure(status, str(error))
    if failure.counts:
        outcome(instance.id, False, str(error))
    return RequestError(failure.code, f"instance {instance.id}: {error}")


class ServedInstance:
    """One ready instance as serving sees it (rebuilt when its server restarts: the slots hold nothing then)."""

    def __init__(
        self,
        instance_id: str,
        port: int,
        slots: int,
        slot_dir: Path,
        generation: object,
        rollback: bool,
        prompt_cache: bool = False,
    ) -> None:
        self.prefill_rate: cost.Estimate | None = None  # prompt tokens/s, from the server's own timings
        self.decode_rate: cost.Estimate | None = None  # one slot's generated tokens/s, likewise
        self.state = cost.StateSize(bytes_per_token=0.0)
        self.id = instance_id
        self.port = port
        self.slot_dir = slot_dir
        self.generation = generation
        self.table = SlotTable(slots, rollback=rollback, prompt_cache=prompt_cache)
        self.wakeups: list[asyncio.Future[None]] = []  # waiters for a slot, woken on every release
        self.identity: str | None = None
        self.context = PromptLimit()
        self.renders = RenderMemo()  # the prompts this incarnation of its server rendered, by body

    def wake(self) -> None:
        for waiter in self.wakeups:
            if not waiter.done():
                waiter.set_result(None)
        self.wakeups.clear()


class SlotHost(Protocol):
    """What a generation needs of the serving shell around its slot: the slot itself, L3, the slot's state files
    and the tasks that run off the reply's path."""

    @property
    def l3(self) -> L3Access | None: ...

    @property
    def limits(self) -> ServingLimits: ...

    async def acquire(
        self, instance: ServedInstance, tokens: Sequence[int], claim: Claim = ANYONE, request_id: str = "",
        scope: str = "",
    ) -> Grant: ...  # fmt: skip

    def release(self, instance: ServedInstance, slot: int, held: Sequence[int] | None) -> None: ...

    def spawn(self, work: Coroutine[Any, Any, None], name: str, /) -> asyncio.Task[None]: ...

    async def restore(self, instance: ServedInstance, slot: int, hit: L3Hit) -> bool: ...

    async def save_slot(self, instance: ServedInstance, slot: int, path: Path, known: int) -> int: ...

    async def prefill_and_save(
        self, instance: ServedInstance, slot: int, prefix: list[int], request_id: str, scope: str = ""
    ) -> int: ...

    def measured(self, instance: ServedInstance, timings: dict[str, Any]) -> None: ...


class ServingShell(SlotHost, Protocol):
    """What the pass-through needs of the serving shell besides the slot: the server's API, the bus its relay
    publishes on, this node's id, the journal and health by inference."""

    @property
    def node_id(self) -> str: ...

    @property
    def api(self) -> ServerApi: ...

    @property
    def bus(self) -> Bus: ...

    def emit(self, event_class: Any, **fields: Any) -> Any: ...

    def outcome(self, instance_id: str, ok: bool, why: str, /) -> None: ...
