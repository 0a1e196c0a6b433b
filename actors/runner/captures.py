"""A serving plan's steps on the slot (runner shell): restore before the answer, capture before or after it, and
the slot given back. Both serving paths (a prompt generation in `serving.py`, a pass-through in `forward.py`)
follow the same `plan.ServingPlan` through these functions; only the answer itself differs between them.

* `before_answer` runs the plan's look-up, restore and capture-before steps and says where the held prefix came
  from and how many prompt tokens the capture's prefill evaluated.
* `after_answer` runs its save and capture-after steps off the reply's path, then gives the slot back holding
  what the plan knows it holds. A save is indexed by the tokens its state file lists (`state_file`), so it
  needs no token ids from the answer; a state holding media is not captured. A capture failing is the
  capture's problem, never the runner's.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from actors.l3.identity import scoped_identity
from actors.runner.plan import Held, ServingPlan, Step
from actors.runner.state_file import PAYLOAD_KIND, SaveFailed, StateFileError, remove_file, state_tokens
from messages.generate import MAX_PROMPT_TOKENS
from messages.l3 import PrefixSource
from runtime.actor import RequestError
from runtime.logging import get_logger

if TYPE_CHECKING:
    from actors.runner.serving import ServedInstance, Serving

__all__ = ["after_answer", "before_answer", "held_tokens"]

_log = get_logger(component="captures")


async def before_answer(
    serving: Serving,
    instance: ServedInstance,
    slot: int,
    plan: ServingPlan,
    tokens: list[int] | None,
    request_id: str,
    scope: str = "",
) -> tuple[PrefixSource, int]:
    """The plan's steps up to the answer: (where the held prefix came from, prompt tokens evaluated meanwhile).
    `scope`: the request's cache scope: only its own states are looked up and captured (`scoped_identity`)."""
    source: PrefixSource = "resident" if plan.held > 0 else "cold"
    evaluated = 0
    action = plan.action
    if action.step is Step.LOOK_UP:
        assert tokens and serving.l3 is not None and instance.identity is not None  # the plan looks up only then
        hit = await serving.l3.lookup(scoped_identity(instance.identity, scope), tokens, max_tokens=action.n_tokens)
        action = plan.looked_up(hit.n_tokens if hit is not None else 0)
        if action.step is Step.RESTORE:
            assert hit is not None
            ok = await serving.restore(instance, slot, hit)
            if ok:
                source = hit.source
                instance.table.update(slot, tokens[: hit.n_tokens])
            action = plan.restored(ok)
    if action.step is Step.CAPTURE_BEFORE:
        assert tokens is not None
        done = await _capture_prefix(serving, instance, slot, tokens[: action.n_tokens], request_id, scope)
        evaluated += done or 0
        plan.prefilled(done is not None)
    return source, evaluated


async def after_answer(
    serving: Serving,
    instance: ServedInstance,
    slot: int,
    plan: ServingPlan,
    tokens: list[int] | None,
    request_id: str,
    *,
    answer: list[int] | None = None,
    scope: str = "",
) -> None:
    """The plan's steps after the answer, then the slot given back. `answer`: the generated token ids when the
    runner knows them all (the slot then holds the prompt and all of them but the last)."""
    listed: list[int] | None = None
    action = plan.action
    try:
        if action.step is Step.SAVE:
            listed = await _save_whole(serving, instance, slot, request_id, scope)
            action = plan.saved(listed is not None)
        if action.step is Step.CAPTURE_AFTER:
            assert tokens is not None
            done = await _capture_prefix(serving, instance, slot, tokens[: action.n_tokens], request_id, scope)
            plan.captured_after(done is not None)
    except Exception as exc:  # a capture failing is the capture's problem, never the runner's
        _log.warning("capture_failed", instance_id=instance.id, error=repr(exc))
        serving.release(instance, slot, None)
        return
    serving.release(instance, slot, held_tokens(plan, tokens, listed, answer))


def held_tokens(
    plan: ServingPlan, tokens: list[int] | None, listed: list[int] | None, answer: list[int] | None = None
) -> tuple[int, ...]:
    """The tokens the slot holds when it is given back, as the plan knows them."""
    held = plan.held_after
    if held is Held.SAVED and listed is not None:
        return tuple(listed)
    if tokens is None:
        return ()
    if held is Held.PREFIX:
        return tuple(tokens[:-1])
    if held is Held.PROMPT:
        return tuple(tokens + answer[:-1]) if answer else tuple(tokens)
    if held is Held.RESTORED:
        return tuple(tokens[: plan.held])
    return ()


async def _capture_prefix(
    serving: Serving, instance: ServedInstance, slot: int, prefix: list[int], request_id: str, scope: str
) -> int | None:
    """Prefills `prefix` into the slot and captures it: the prompt tokens it evaluated, None when the server
    refused the prefill (e.g. the prompt is over the context: the answer will say so itself)."""
    try:
        return await serving.prefill_and_save(instance, slot, prefix, request_id, scope)
    except RequestError as exc:
        _log.info("prefix_capture_skipped", instance_id=instance.id, error=str(exc))
        instance.table.update(slot, ())
        return None


async def _save_whole(
    serving: Serving, instance: ServedInstance, slot: int, request_id: str, scope: str
) -> list[int] | None:
    """Saves the slot and captures it under the tokens its state file lists (None: not saved)."""
    owned = False  # the store took the file
    path = instance.slot_dir / f"capture-{request_id}-{uuid.uuid4().hex[:8]}.bin"
    try:
        await serving.save_slot(instance, slot, path, MAX_PROMPT_TOKENS)
        listed = await asyncio.to_thread(state_tokens, path, max_tokens=MAX_PROMPT_TOKENS)
        if listed.tokens and not listed.media and serving.l3 is not None and instance.identity is not None:
            identity = scoped_identity(instance.identity, scope)
            serving.l3.capture(path, identity=identity, tokens=listed.tokens, payload_kind=PAYLOAD_KIND)
            owned = True
        return listed.tokens
    except (SaveFailed, StateFileError, OSError) as exc:
        _log.warning("capture_failed", instance_id=instance.id, error=str(exc))
        return None
    finally:
        if not owned:
            await remove_file(path)
