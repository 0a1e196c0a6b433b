"""What a served request's answer means (`serving_rules`), and the one walk of a serving plan on its slot that both
serving paths share (`captures.SlotRun`, driven here against a fake serving shell)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from actors.l3.api import CaptureOutcome, L3Access, L3Hit
from actors.runner import serving_rules as rules
from actors.runner.captures import SlotRun
from actors.runner.fairqueue import Claim
from actors.runner.passthrough import AnswerTokens
from actors.runner.served import ServedInstance, ServingLimits, refuse_oversize, server_failed
from actors.runner.server_api import ServerApiError
from actors.runner.slots import ANYONE, Grant, PromptLimit
from actors.runner.state_file import SaveFailed
from messages.errors import BAD_REQUEST, UNAVAILABLE
from runtime.actor import RequestError

# ---- the mesh's own completion ----


def test_a_completion_whose_count_matches_the_ids_received_keeps_them_and_one_cancelled_keeps_nothing() -> None:
    answer = rules.generation_answer({"tokens_predicted": 3, "stop_type": "eos"}, 3, cancelled=False)
    assert answer == rules.GenerationAnswer(stop="eos", generated=3, exact=True)
    assert answer.completed and answer.ids_known
    left = rules.generation_answer({"tokens_predicted": 3, "stop_type": "eos"}, 3, cancelled=True)
    assert left.stop == "cancelled" and not left.completed and not left.ids_known


def test_a_stream_that_held_back_ids_is_not_exact_and_the_servers_count_is_the_generated_one() -> None:
    answer = rules.generation_answer({"tokens_predicted": 5, "stop_type": "word"}, 4, cancelled=False)
    assert (answer.stop, answer.generated, answer.exact, answer.ids_known) == ("stop_word", 5, False, False)


def test_an_answer_that_never_came_counts_the_ids_received() -> None:
    answer = rules.generation_answer({}, 2, cancelled=True)  # the requester left before the last event
    assert (answer.generated, answer.exact, answer.stop) == (2, True, "cancelled")
    assert rules.generation_answer({"tokens_predicted": 0}, 0, cancelled=False).generated == 0


# ---- a relayed answer ----


def test_a_relayed_answer_is_kept_only_when_it_is_a_200_the_requester_stayed_for() -> None:
    assert rules.relay_completed(200, cancelled=False)
    assert not rules.relay_completed(200, cancelled=True)
    assert not rules.relay_completed(400, cancelled=False)
    assert not rules.relay_completed(0, cancelled=False)


def test_a_relayed_answer_stops_as_it_says_unless_its_requester_left() -> None:
    answers = [{"choices": [{"finish_reason": "length"}]}]
    assert rules.relay_stop(answers, cancelled=False) == "limit"
    assert rules.relay_stop(answers, cancelled=True) == "cancelled"
    assert rules.relay_stop([], cancelled=False) == "eos"


def test_a_requester_that_left_is_charged_the_rendered_prompt_and_what_the_slot_decoded() -> None:
    said = AnswerTokens(prompt=0, cached=2, evaluated=8, generated=3)
    assert rules.relay_charge(said, cancelled=False, prompt_tokens=10, decoded=7) == said
    charged = rules.relay_charge(said, cancelled=True, prompt_tokens=10, decoded=7)
    assert charged == AnswerTokens(prompt=10, cached=2, evaluated=8, generated=7)
    counted = AnswerTokens(prompt=12, generated=9)  # the answer said more than was seen decoding: its word stands
    assert rules.relay_charge(counted, cancelled=True, prompt_tokens=10, decoded=7) == counted


# ---- the server's clock ----


def test_the_first_token_by_the_servers_clock_is_the_prompt_time_and_one_tokens() -> None:
    assert rules.first_token_s({"prompt_ms": 120.0, "predicted_per_token_ms": 30}) == pytest.approx(0.15)
    assert rules.first_token_s({"prompt_ms": 50}) == pytest.approx(0.05)
    assert rules.first_token_s({"prompt_ms": -1, "predicted_per_token_ms": True}) == 0.0  # not a time


def test_a_handoff_adds_what_the_remote_prompt_computation_did_not_take_and_never_less_than_nothing() -> None:
    assert rules.handoff_ms(500.0, compute_ms=300.0, prefill_ms=400.0, last_token_ms=20.0) == pytest.approx(220.0)
    # no compute time reported: the whole remote prefill is what the cost model counts as its computation
    assert rules.handoff_ms(500.0, compute_ms=0.0, prefill_ms=400.0, last_token_ms=0.0) == pytest.approx(100.0)
    assert rules.handoff_ms(100.0, compute_ms=300.0, prefill_ms=400.0, last_token_ms=5.0) == 0.0


# ---- the one oversize refusal ----


def test_a_prompt_its_slot_can_never_hold_is_refused_by_its_tokens_its_text_or_its_size() -> None:
    limit = PromptLimit(n_ctx_seq=8, longest_token_bytes=4)
    refuse_oversize(limit, tokens=8, text="x" * 32, text_bytes=32)  # at the limit: served
    for asked in ({"tokens": 9}, {"text": "x" * 33}, {"text_bytes": 33}):
        with pytest.raises(RequestError) as refused:
            refuse_oversize(limit, **asked)
        assert refused.value.reply.code == BAD_REQUEST


def test_a_server_that_failed_is_told_to_health_and_a_request_it_refused_is_not() -> None:
    told: list[tuple[str, bool, str]] = []
    instance = _instance()
    broken = server_failed(lambda *said: told.append(said), instance, ServerApiError("connection refused"), None)
    assert (broken.reply.code, str(broken)) == (UNAVAILABLE, "instance i1: connection refused")
    assert told == [("i1", False, "connection refused")]
    refused = server_failed(lambda *said: told.append(said), instance, ServerApiError("bad grammar"), 400)
    assert refused.reply.code == BAD_REQUEST and len(told) == 1


# ---- the plan walked on the slot ----


class FakeHost:
    """A serving shell that records what the run asks of it (no L3, no server)."""

    def __init__(self) -> None:
        self.l3: L3Access | None = None
        self.limits = ServingLimits(capture_min_tokens=4)
        self.released: list[tuple[int, tuple[int, ...] | None]] = []
        self.spawned: list[str] = []
        self.prefilled: list[list[int]] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def acquire(
        self, instance: ServedInstance, tokens: Sequence[int], claim: Claim = ANYONE, request_id: str = "",
        scope: str = "",
    ) -> Grant:  # fmt: skip
        raise AssertionError("a run is handed an acquired slot")

    def release(self, instance: ServedInstance, slot: int, held: Sequence[int] | None) -> None:
        self.released.append((slot, tuple(held) if held is not None else None))

    def spawn(self, work: Coroutine[Any, Any, None], name: str, /) -> asyncio.Task[None]:
        self.spawned.append(name)
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.append(task)
        return task

    async def restore(self, instance: ServedInstance, slot: int, hit: L3Hit) -> bool:
        raise AssertionError("no L3 here")

    async def save_slot(self, instance: ServedInstance, slot: int, path: Path, known: int) -> int:
        raise SaveFailed("save_failed", "the server could not write it")

    async def prefill_and_save(
        self, instance: ServedInstance, slot: int, prefix: list[int], request_id: str, scope: str = ""
    ) -> int:
        self.prefilled.append(prefix)
        return len(prefix)

    def measured(self, instance: ServedInstance, timings: dict[str, Any]) -> None:
        pass


class EmptyL3:
    """A store that holds nothing and takes nothing."""

    async def lookup(self, identity: str, tokens: Sequence[int], *, max_tokens: int) -> L3Hit | None:
        return None

    async def materialize(self, hit: L3Hit, dest: Path, *, deadline_s: float) -> None:
        raise AssertionError("nothing to materialize")

    def capture(self, source: Path, *, identity: str, tokens: Sequence[int], payload_kind: str) -> None:
        raise AssertionError("nothing is saved")

    async def store(self, source: Path, *, identity: str, tokens: Sequence[int], payload_kind: str) -> CaptureOutcome:
        raise AssertionError("nothing is saved")


def _instance(*, rollback: bool = True) -> ServedInstance:
    return ServedInstance("i1", 8080, 1, Path("/nonexistent"), generation=1, rollback=rollback)


def _grant(instance: ServedInstance, tokens: list[int]) -> Grant:
    grant = instance.table.acquire(tokens)
    assert grant is not None
    return grant


async def test_an_answered_run_gives_its_slot_back_holding_the_prompt_and_the_known_answer() -> None:
    host, instance, prompt = FakeHost(), _instance(), [1, 2, 3]
    with SlotRun(host, instance, _grant(instance, prompt), prompt, capture=True, request_id="r1") as run:
        assert await run.before_answer() == ("cold", 0)
        run.answered(completed=True, prompt_counted=3, generated=2, answer=[7, 8])
    assert host.released == [(0, (1, 2, 3, 7))]  # all but the last generated token: it was never evaluated
    assert run.plan.capture_note == "no_l3" and host.spawned == []


async def test_a_run_left_before_its_answer_gives_the_slot_back_holding_nothing() -> None:
    host, instance, prompt = FakeHost(), _instance(), [1, 2, 3]
    with pytest.raises(RequestError), SlotRun(host, instance, _grant(instance, prompt), prompt, capture=False,
                                              request_id="r1") as run:  # fmt: skip
        await run.before_answer()
        raise RequestError(BAD_REQUEST, "the server refused it")
    assert host.released == [(0, None)]


async def test_an_unfinished_answer_gives_the_slot_back_holding_nothing_once() -> None:
    host, instance, prompt = FakeHost(), _instance(), [1, 2, 3]
    with SlotRun(host, instance, _grant(instance, prompt), None, capture=False, request_id="r1") as run:
        await run.before_answer()
        run.answered(completed=False, prompt_counted=0, generated=1)
    assert host.released == [(0, ())]


async def test_a_model_that_cannot_roll_back_captures_before_the_answer_and_saves_after_it_off_the_reply() -> None:
    host, instance, prompt = FakeHost(), _instance(rollback=False), [1, 2, 3, 4, 5, 6]
    host.l3, instance.identity = EmptyL3(), "ab" * 32
    with SlotRun(host, instance, _grant(instance, prompt), prompt, capture=True, request_id="r1") as run:
        assert await run.before_answer() == ("cold", 5)  # looked up (nothing), then the prompt less a token
        assert host.prefilled == [[1, 2, 3, 4, 5]]
        run.answered(completed=True, prompt_counted=6, generated=3)
    assert host.spawned == ["capture:r1"] and host.released == []  # the slot is the captures' until they end
    await asyncio.gather(*host.tasks)
    assert host.released == [(0, ())]  # the save failed: what the slot holds is unknown
    assert run.plan.capture_note == "queued"
