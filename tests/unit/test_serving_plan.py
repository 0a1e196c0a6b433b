"""The serving plan (runner core): restore, capture before or after the answer, what the slot holds after."""

from __future__ import annotations

import pytest

from actors.runner.plan import Action, Held, PlanError, ServingPlan, Step

MIN = 256


def plan(n_tokens: int | None = 1000, resident: int = 0, **fields: bool) -> ServingPlan:
    options = {"store": True, "capture": True, "rollback": True, **fields}
    return ServingPlan(n_tokens, resident, capture_min_tokens=MIN, **options)


def test_a_cold_long_prompt_on_a_model_that_rolls_back_is_answered_first_then_saved_and_cut_back() -> None:
    p = plan()
    assert p.action == Action(Step.LOOK_UP, 999)
    assert p.looked_up(0) == Action(Step.FORWARD)  # nothing before the answer: its usage stays the server's
    assert p.answered(completed=True, prompt_counted=1000, generated=8) == Action(Step.SAVE)
    assert p.saved(True) == Action(Step.CAPTURE_AFTER, 999)  # the prompt less a token: one token evaluated
    assert p.captured_after(True) == Action(Step.RELEASE)
    assert p.held_after is Held.PREFIX and p.capture_note == "queued"


def test_a_cold_long_prompt_on_a_recurrent_model_is_captured_before_the_answer() -> None:
    p = plan(rollback=False)
    assert p.looked_up(0) == Action(Step.CAPTURE_BEFORE, 999)  # a recurrent state cannot be cut back later
    assert p.prefilled(True) == Action(Step.FORWARD)
    assert p.held == 999 and p.capture_note == "queued"
    assert p.answered(completed=True, prompt_counted=1000, generated=8) == Action(Step.SAVE)
    assert p.saved(True) == Action(Step.RELEASE) and p.held_after is Held.SAVED


def test_a_longer_stored_prefix_is_restored_and_a_prompt_held_to_its_last_token_is_not_captured_again() -> None:
    p = plan(resident=100, rollback=False)
    assert p.looked_up(999) == Action(Step.RESTORE, 999)
    assert p.restored(True) == Action(Step.FORWARD)
    assert (p.held, p.restored_tokens, p.capture_note) == (999, 999, "held")
    shorter = plan(resident=500)
    assert shorter.looked_up(300) == Action(Step.FORWARD)  # not longer than what the slot holds
    assert shorter.restored_tokens == 0 and shorter.held == 500


def test_a_failed_restore_leaves_the_slot_holding_nothing() -> None:
    p = plan(resident=100, rollback=False)
    p.looked_up(600)
    assert p.restored(False) == Action(Step.CAPTURE_BEFORE, 999)
    assert p.held == 0 and p.held_after is Held.NOTHING


def test_a_refused_prefill_drops_the_capture_and_forwards_anyway() -> None:
    p = plan(rollback=False)
    p.looked_up(0)
    assert p.prefilled(False) == Action(Step.FORWARD)
    assert p.capture_note == "prefill_refused" and p.held == 0


def test_short_prompts_and_short_answers_are_not_kept_and_the_slot_holds_the_prompt() -> None:
    p = plan(n_tokens=40)
    assert p.action == Action(Step.LOOK_UP, 39)  # a stored prefix still helps
    assert p.looked_up(0) == Action(Step.FORWARD)
    assert p.answered(completed=True, prompt_counted=40, generated=5) == Action(Step.RELEASE)
    assert p.held_after is Held.PROMPT and p.capture_note == "short"
    # a short prompt with a long answer: the whole slot is worth keeping
    q = plan(n_tokens=40)
    q.looked_up(0)
    assert q.answered(completed=True, prompt_counted=40, generated=400) == Action(Step.SAVE)
    assert q.saved(True) == Action(Step.RELEASE)


def test_a_cancelled_or_failed_answer_leaves_the_slot_holding_nothing() -> None:
    p = plan()
    p.looked_up(0)
    assert p.answered(completed=False, prompt_counted=1000, generated=3) == Action(Step.RELEASE)
    assert p.held_after is Held.NOTHING


def test_a_prompt_the_mesh_did_not_render_is_forwarded_and_its_saved_state_kept() -> None:
    p = plan(n_tokens=None)
    assert p.action == Action(Step.FORWARD)  # no tokens: nothing to look up
    assert p.answered(completed=True, prompt_counted=900, generated=10) == Action(Step.SAVE)
    assert p.saved(True) == Action(Step.RELEASE) and p.held_after is Held.SAVED


def test_a_prompt_the_server_rendered_otherwise_is_not_cut_back_to_the_meshs_rendering() -> None:
    p = plan()
    p.looked_up(0)
    assert p.answered(completed=True, prompt_counted=1003, generated=10) == Action(Step.SAVE)
    assert p.saved(True) == Action(Step.RELEASE)  # its file lists the server's own tokens
    assert p.held_after is Held.SAVED


def test_capture_off_and_no_store_keep_nothing() -> None:
    off = plan(capture=False)
    off.looked_up(0)
    assert off.answered(completed=True, prompt_counted=1000, generated=10) == Action(Step.RELEASE)
    assert off.capture_note == "off" and off.held_after is Held.PROMPT
    none = plan(store=False)
    assert none.action == Action(Step.FORWARD) and none.capture_note == "no_l3"


def test_an_event_the_step_does_not_expect_is_an_error() -> None:
    p = plan()
    with pytest.raises(PlanError, match="restore reported while the plan is at look_up"):
        p.restored(True)
    p.looked_up(0)
    with pytest.raises(PlanError):
        p.saved(True)
