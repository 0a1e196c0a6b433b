"""The serving plan of one generation on one slot (runner core, pure): what to restore, when to capture, what
the slot holds afterwards.

Theory of operation (h11's way): a `ServingPlan` starts from what the shell knows before it touches the
server (the prompt's tokens when they were rendered, the prefix the acquired slot already holds, whether the
model can roll its state back, whether capture is on). `action` is the next thing to do; the shell does it and
feeds back what happened (`looked_up`, `restored`, `prefilled`, `answered`, `saved`); each moves the plan along
the transition table `_NEXT`, and an event the current step does not expect is a `PlanError` (a shell bug).
Nothing here does I/O or reads a clock.

Rules this module keeps:

* L3 is looked up only with the prompt's tokens, a store and an identity, and while the slot holds less than
  all but the prompt's last token (the server must compute the last position's logits itself). A hit longer
  than what the slot holds is restored; a failed restore leaves the slot holding nothing.
* A prompt at least `capture_min_tokens` long is captured one token short, unless the slot already held that:
  - on a model that cannot roll its state back (recurrent layers), *before* the answer: the state after the
    prompt could not be rewound, so the same prompt again would be computed from the start. The server's usage
    then counts the prompt as cached, since this request computed it in two calls;
  - on one that can, *after* a completed answer: the slot is cut back to the prompt less one token (one token
    evaluated) and saved, so the answer's usage is the server's plain count.
  A prefill the server refuses before the answer (the prompt is longer than the context: the answer will say
  so) drops the capture; the body is forwarded anyway.
* After a completed answer whose prompt and answer are long enough to keep, the whole slot is saved first
  (prompt and answer: the next turn of a conversation extends it).
* The slot given back holds what the mesh knows it holds: the prefix last captured, else what the last save
  listed, else the rendered prompt when the server counted exactly as many prompt tokens, else nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

__all__ = ["Action", "Held", "PlanError", "ServingPlan", "Step"]


class PlanError(Exception):
    """An event the plan's current step does not expect."""


class Step(enum.Enum):
    LOOK_UP = "look_up"  # ask L3 for a prefix longer than the slot holds
    RESTORE = "restore"  # write that prefix into the slot
    CAPTURE_BEFORE = "capture_before"  # prefill the prompt one token short and capture it
    FORWARD = "forward"  # the request itself
    SAVE = "save"  # save the whole slot after a completed answer and capture it
    CAPTURE_AFTER = "capture_after"  # cut the slot back to the prompt less one token and capture it
    RELEASE = "release"  # give the slot back (`held` says what it holds)


class Held(enum.Enum):
    NOTHING = "nothing"
    RESTORED = "restored"  # the restored prefix (before the answer)
    PROMPT = "prompt"  # the rendered prompt, the server having counted as many prompt tokens
    SAVED = "saved"  # what the last save listed
    PREFIX = "prefix"  # the prompt less its last token


@dataclass(frozen=True)
class Action:
    step: Step
    n_tokens: int = 0  # LOOK_UP: the longest prefix wanted; CAPTURE_*: how many tokens to prefill and keep


#: step -> the steps that may follow it (checked on every move).
_NEXT: Final[dict[Step, frozenset[Step]]] = {
    Step.LOOK_UP: frozenset({Step.RESTORE, Step.CAPTURE_BEFORE, Step.FORWARD}),
    Step.RESTORE: frozenset({Step.CAPTURE_BEFORE, Step.FORWARD}),
    Step.CAPTURE_BEFORE: frozenset({Step.FORWARD}),
    Step.FORWARD: frozenset({Step.SAVE, Step.CAPTURE_AFTER, Step.RELEASE}),
    Step.SAVE: frozenset({Step.CAPTURE_AFTER, Step.RELEASE}),
    Step.CAPTURE_AFTER: frozenset({Step.RELEASE}),
    Step.RELEASE: frozenset(),
}


class ServingPlan:
    """One generation's way through its slot. `n_tokens`: the rendered prompt's length (None: not rendered);
    `resident`: the prefix of it the slot holds; `store`: there is an L3 store and an identity for its states;
    `capture`: the request allows capture (and its prompt holds no media); `rollback`: the model's state can be
    cut back (no recurrent layers)."""

    def __init__(
        self,
        n_tokens: int | None,
        resident: int,
        *,
        store: bool,
        capture: bool,
        rollback: bool,
        capture_min_tokens: int,
    ) -> None:
        self.n_tokens = n_tokens
        self.held = resident  # tokens of the prompt the slot holds before the answer
        self.restored_tokens = 0  # of them, restored from L3
        self._rendered_alike = False  # the server counted as many prompt tokens as the mesh rendered
        self.held_after = Held.RESTORED if resident else Held.NOTHING
        self.rollback = rollback
        self.capture_note = "off" if not capture else "no_l3" if not store else "short"
        self._store = store
        self._capture = capture and store
        self._min = capture_min_tokens
        self._hit = 0
        self._step = Step.LOOK_UP
        if store and n_tokens is not None and resident < n_tokens - 1:
            self.action = Action(Step.LOOK_UP, n_tokens - 1)
        else:
            self.action = self._before_forward()

    # --- before the answer --------------------------------------------------------------------------------

    def _prefix(self) -> int | None:
        """The prompt less its last token, when it is long enough to keep and capture is on (else None)."""
        n = self.n_tokens
        return n - 1 if self._capture and n is not None and n - 1 >= self._min else None

    def _before_forward(self) -> Action:
        prefix = self._prefix()
        if prefix is not None and self.held >= prefix:
            self.capture_note = "held"
        elif prefix is not None and not self.rollback:
            return self._move(Step.CAPTURE_BEFORE, prefix)
        return self._move(Step.FORWARD)

    def looked_up(self, hit_tokens: int) -> Action:
        """L3's longest stored prefix of the prompt (0: none)."""
        self._expect(Step.LOOK_UP)
        if hit_tokens > self.held:
            self._hit = hit_tokens
            return self._move(Step.RESTORE, hit_tokens)
        return self._before_forward()

    def restored(self, ok: bool) -> Action:
        self._expect(Step.RESTORE)
        if ok:
            self.held = self.restored_tokens = self._hit
            self.held_after = Held.RESTORED
        else:
            self.held, self.held_after = 0, Held.NOTHING
        return self._before_forward()

    def prefilled(self, ok: bool) -> Action:
        """The capture before the answer: done, or refused by the server (the answer will say why)."""
        self._expect(Step.CAPTURE_BEFORE)
        if ok:
            self.held, self.held_after, self.capture_note = self.action.n_tokens, Held.PREFIX, "queued"
        else:
            self.held, self.held_after, self.capture_note = 0, Held.NOTHING, "prefill_refused"
        return self._move(Step.FORWARD)

    # --- after it -----------------------------------------------------------------------------------------

    def answered(self, *, completed: bool, prompt_counted: int, generated: int) -> Action:
        """The server's answer: `completed` (a 200 the requester stayed for), the prompt tokens it counted and
        the tokens it generated."""
        self._expect(Step.FORWARD)
        if not completed:
            self.held_after = Held.NOTHING  # an error or a stop midway: what the slot holds is unknown
            return self._move(Step.RELEASE)
        self._rendered_alike = prompt_counted == self.n_tokens
        self.held_after = Held.PROMPT if self._rendered_alike else Held.NOTHING
        if self._capture and prompt_counted + generated - 1 >= self._min:
            self.capture_note = "queued"
            return self._move(Step.SAVE)
        return self._after_save()

    def saved(self, ok: bool) -> Action:
        """The whole slot's save after the answer (its tokens are what its file lists)."""
        self._expect(Step.SAVE)
        self.held_after = Held.SAVED if ok else Held.NOTHING
        return self._after_save()

    def _after_save(self) -> Action:
        prefix = self._prefix()
        # cut back to the prompt less a token: one token evaluated, when the slot holds the prompt as rendered
        if self.rollback and prefix is not None and self.held < prefix and self._rendered_alike:
            self.capture_note = "queued"
            return self._move(Step.CAPTURE_AFTER, prefix)
        return self._move(Step.RELEASE)

    def captured_after(self, ok: bool) -> Action:
        self._expect(Step.CAPTURE_AFTER)
        self.held_after = Held.PREFIX if ok else Held.NOTHING
        return self._move(Step.RELEASE)

    # --- the table ----------------------------------------------------------------------------------------

    def _expect(self, step: Step) -> None:
        if self._step is not step:
            raise PlanError(f"{step.value} reported while the plan is at {self._step.value}")

    def _move(self, step: Step, n_tokens: int = 0) -> Action:
        if step not in _NEXT[self._step]:
            raise PlanError(f"no move from {self._step.value} to {step.value}")
        self._step = step
        self.action = Action(step, n_tokens)
        return self.action
