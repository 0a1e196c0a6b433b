"""A serving plan followed on its acquired slot (runner shell): restore before the answer, capture before or
after it, and the slot given back. Both serving paths (a prompt generation in `serving.py`, a pass-through in
`forward.py`) hand their slot to a `SlotRun`, the one place that walks a `plan.ServingPlan` through its steps;
only the answer itself differs between them.

* `SlotRun.before_answer` runs the plan's look-up, restore and capture-before steps and says where the held
  prefix came from and how many prompt tokens the capture's prefill evaluated.
* `SlotRun.answered` feeds the answer to the plan and hands the slot over: given back at once, or to the save and
  capture-after steps, which run off the reply's path and then give it back holding what the plan knows it
  holds. A save is indexed by the tokens its state file lists (`state_file`), so it needs no token ids from the
  answer; a state holding media is not captured. A capture failing is the capture's problem, never the
  runner's.
* A run left before its answer (an error, a deadline) gives the slot back holding nothing.

What a run needs of the serving shell is `served.SlotHost`.
"""

from __future__ import annotations

import asyncio
import uuid

from actors.l3.identity import scoped_identity
from actors.runner.plan import Held, ServingPlan, Step
from actors.runner.served import ServedInstance, SlotHost
from actors.runner.slots import Grant
from actors.runner.state_file import PAYLOAD_KIND, SaveFailed, StateFileError, remove_file, state_tokens
from messages.generate import MAX_PROMPT_TOKENS
from messages.l3 import PrefixSource
from runtime.actor import RequestError
from runtime.logging import get_logger

__all__ = ["SlotRun", "held_tokens"]

_log = get_logger(component="captures")


class SlotRun:
    """One generation's serving plan on its acquired slot, used as a `with` block around the answer. `tokens`:
    the rendered prompt (None: not rendered); `capture`: the request allows capture (and its prompt holds no
    media); `scope`: the request's cache scope: only its own states are looked up and captured
    (`scoped_identity`)."""

    def __init__(
        self,
        host: SlotHost,
        instance: ServedInstance,
        grant: Grant,
        tokens: list[int] | None,
        *,
        capture: bool,
        request_id: str,
        scope: str = "",
    ) -> None:
        self.plan = ServingPlan(
            len(tokens) if tokens else None,
            grant.resident,
            store=host.l3 is not None and instance.identity is not None,
            capture=capture,
            rollback=instance.table.rollback,
            capture_min_tokens=host.limits.capture_min_tokens,
        )
        self._host = host
        self._instance = instance
        self._slot = grant.slot
        self._tokens = tokens
        self._request_id = request_id
        self._scope = scope
        self._handed_over = False

    def __enter__(self) -> SlotRun:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handed_over:  # no answer: what the slot holds is unknown
            self._host.release(self._instance, self._slot, None)

    async def before_answer(self) -> tuple[PrefixSource, int]:
        """The plan's steps up to the answer: (where the held prefix came from, prompt tokens evaluated meanwhile)."""
        host, instance, slot, plan, tokens = self._host, self._instance, self._slot, self.plan, self._tokens
        source: PrefixSource = "resident" if plan.held > 0 else "cold"
        evaluated = 0
        action = plan.action
        if action.step is Step.LOOK_UP:
            assert tokens and host.l3 is not None and instance.identity is not None  # the plan looks up only then
            identity = scoped_identity(instance.identity, self._scope)
            hit = await host.l3.lookup(identity, tokens, max_tokens=action.n_tokens)
            action = plan.looked_up(hit.n_tokens if hit is not None else 0)
            if action.step is Step.RESTORE:
                assert hit is not None
                ok = await host.restore(instance, slot, hit)
                if ok:
                    source = hit.source
                    instance.table.update(slot, tokens[: hit.n_tokens])
                action = plan.restored(ok)
        if action.step is Step.CAPTURE_BEFORE:
            assert tokens is not None
            done = await self._capture_prefix(tokens[: action.n_tokens])
            evaluated += done or 0
            plan.prefilled(done is not None)
        return source, evaluated

    def answered(
        self, *, completed: bool, prompt_counted: int, generated: int, answer: list[int] | None = None
    ) -> None:
        """The server's answer (`ServingPlan.answered`), then the slot handed over. `answer`: the generated token
        ids when the runner knows them all (the slot then holds the prompt and all of them but the last)."""
        action = self.plan.answered(completed=completed, prompt_counted=prompt_counted, generated=generated)
        held = held_tokens(self.plan, self._tokens, None, answer)
        if action.step is Step.RELEASE:
            self._host.release(self._instance, self._slot, held)
        else:  # the captures after the answer run off the reply's path; they give the slot back
            self._instance.table.finishing(self._slot, held)
            self._host.spawn(self._after_answer(answer), f"capture:{self._request_id}")
        self._handed_over = True

    async def _after_answer(self, answer: list[int] | None) -> None:
        """The plan's steps after the answer, then the slot given back."""
        listed: list[int] | None = None
        action = self.plan.action
        try:
            if action.step is Step.SAVE:
                listed = await self._save_whole()
                action = self.plan.saved(listed is not None)
            if action.step is Step.CAPTURE_AFTER:
                assert self._tokens is not None
                done = await self._capture_prefix(self._tokens[: action.n_tokens])
                self.plan.captured_after(done is not None)
        except Exception as exc:  # a capture failing is the capture's problem, never the runner's
            _log.warning("capture_failed", instance_id=self._instance.id, error=repr(exc))
            self._host.release(self._instance, self._slot, None)
            return
        self._host.release(self._instance, self._slot, held_tokens(self.plan, self._tokens, listed, answer))

    async def _capture_prefix(self, prefix: list[int]) -> int | None:
        """Prefills `prefix` into the slot and captures it: the prompt tokens it evaluated, None when the server
        refused the prefill (e.g. the prompt is over the context: the answer will say so itself)."""
        instance = self._instance
        try:
            return await self._host.prefill_and_save(instance, self._slot, prefix, self._request_id, self._scope)
        except RequestError as exc:
            _log.info("prefix_capture_skipped", instance_id=instance.id, error=str(exc))
            instance.table.update(self._slot, ())
            return None

    async def _save_whole(self) -> list[int] | None:
        """Saves the slot and captures it under the tokens its state file lists (None: not saved)."""
        host, instance = self._host, self._instance
        owned = False  # the store took the file
        path = instance.slot_dir / f"capture-{self._request_id}-{uuid.uuid4().hex[:8]}.bin"
        try:
            await host.save_slot(instance, self._slot, path, MAX_PROMPT_TOKENS)
            listed = await asyncio.to_thread(state_tokens, path, max_tokens=MAX_PROMPT_TOKENS)
            if listed.tokens and not listed.media and host.l3 is not None and instance.identity is not None:
                identity = scoped_identity(instance.identity, self._scope)
                host.l3.capture(path, identity=identity, tokens=listed.tokens, payload_kind=PAYLOAD_KIND)
                owned = True
            return listed.tokens
        except (SaveFailed, StateFileError, OSError) as exc:
            _log.warning("capture_failed", instance_id=instance.id, error=str(exc))
            return None
        finally:
            if not owned:
                await remove_file(path)


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
