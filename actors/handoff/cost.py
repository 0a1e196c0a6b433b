"""Phase placement cost model: prefill here, or prefill on a faster node and hand the state over (pure).

Rules this module keeps:

* `n` is the length of the state the decoding node needs (the prompt but its last token). Each side computes
  only what it does not already hold: local time is `(n - local_held) / local_rate`; remote time is
  `(n - remote_held) / remote_rate` plus the part of the transfer that the remote prefill does not hide
  (`1 - overlap` of `state_bytes(n) / link_rate`: segments stream while later ones are still being
  prefilled) plus a fixed per-handoff cost (open, commit, restore). The prefix the decoding node holds saves
  nothing on the remote path: the state handed over is the whole prompt's, computed where it is sent from
  (pricing the remote side with the local holding chose a remote prefill estimated at 10 s that took 160 s).
* The state moved is `floor + bytes_per_token * n`, all `n` tokens of it: KV bytes per token from the memory
  model, and the recurrent floor of hybrid models, a constant state size whatever the token count (a pure
  recurrent model moves only the floor).
* Arithmetic is exact (`fractions.Fraction` of the float inputs), so a crossover that falls on an integer is
  found as that integer: break-even is the first token count that strictly wins, `floor(crossover) + 1`, never
  "none" because a float rounded the wrong way. Equal nodes never disaggregate: with the same prefill rate,
  and no more of the prompt held there than here, the transfer can only add time.
* Rates are measured and smoothed (`observe`: an exponentially weighted moving average, seeded by the first
  sample), from llama-server's own timings (prefill tokens/s per instance). A link (node pair) is a line,
  `seconds = fixed_s + bytes / bytes_per_s`, fitted by least squares on measured handoffs (`fit_link`): a
  probe's handoffs of two sizes, or what disaggregated generations reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from messages.memory import MemoryBreakdown

__all__ = [
    "Decision",
    "Estimate",
    "Link",
    "Rates",
    "StateSize",
    "breakeven",
    "decide",
    "fit_link",
    "local_seconds",
    "observe",
    "rate",
    "remote_seconds",
    "remote_wins",
]


@dataclass(frozen=True, slots=True)
class StateSize:
    """The bytes a saved state of `n` tokens holds: `floor_bytes + bytes_per_token * n`."""

    bytes_per_token: float  # KV per token, every attention layer and stream the state carries
    floor_bytes: float = 0.0  # recurrent state (hybrid and recurrent models) and fixed headers

    def __post_init__(self) -> None:
        if not (self.bytes_per_token >= 0 and self.floor_bytes >= 0):
            raise ValueError("state sizes cannot be negative")

    def at(self, n_tokens: int) -> float:
        return self.floor_bytes + self.bytes_per_token * n_tokens

    @classmethod
    def of_slot(cls, breakdown: MemoryBreakdown) -> StateSize:
        """What one slot's saved state holds, from the memory model's breakdown: KV per token of every
        full-attention layer (and of the sliding-window layers, whose cells a `--swa-full` cache keeps per
        token), plus one sequence's recurrent state (one cell, no rollback rows) as the floor."""
        shape = breakdown.context
        full = breakdown.kv_bytes - breakdown.kv_swa_bytes
        per_token = full / shape.n_ctx if shape.n_ctx else 0.0
        if breakdown.kv_swa_bytes and shape.swa_cells:
            per_token += breakdown.kv_swa_bytes / (shape.swa_cells * max(1, shape.n_stream))
        rows = max(1, shape.n_seq_max) * (1 + shape.n_rs_seq)
        return cls(bytes_per_token=per_token, floor_bytes=breakdown.recurrent_bytes / rows)


@dataclass(frozen=True, slots=True)
class Rates:
    local_tokens_per_s: float  # prefill rate of the instance that would decode (the target)
    remote_tokens_per_s: float  # prefill rate of the candidate prefill instance
    link_bytes_per_s: float  # handoff throughput from the prefill node to the target
    overlap: float = 0.0  # the share of the transfer hidden behind the remote prefill, in [0, 1]
    fixed_s: float = 0.0  # per handoff: open, commit, restore

    def __post_init__(self) -> None:
        if not (self.local_tokens_per_s > 0 and self.remote_tokens_per_s > 0 and self.link_bytes_per_s > 0):
            raise ValueError("rates must be positive")
        if not (0.0 <= self.overlap <= 1.0) or not self.fixed_s >= 0:
            raise ValueError("overlap is in [0, 1] and the fixed cost is not negative")
        for value in (self.local_tokens_per_s, self.remote_tokens_per_s, self.link_bytes_per_s, self.fixed_s):
            if not math.isfinite(value):
                raise ValueError("rates must be finite")


def _q(value: float) -> Fraction:
    return Fraction(value)


def _to_compute(n: int, held: int) -> int:
    if n < 0 or held < 0:
        raise ValueError("token counts cannot be negative")
    return n - min(held, n)


def _local(n: int, rates: Rates, held: int = 0) -> Fraction:
    return Fraction(_to_compute(n, held)) / _q(rates.local_tokens_per_s)


def _remote(n: int, size: StateSize, rates: Rates, held: int = 0) -> Fraction:
    moved = _q(size.floor_bytes) + _q(size.bytes_per_token) * n  # the whole state, whatever either side held
    exposed = (1 - _q(rates.overlap)) * moved / _q(rates.link_bytes_per_s)
    return Fraction(_to_compute(n, held)) / _q(rates.remote_tokens_per_s) + exposed + _q(rates.fixed_s)


def local_seconds(n_tokens: int, rates: Rates, *, held: int = 0) -> float:
    """Prefilling a state of `n_tokens` where it decodes, `held` of them already there."""
    return float(_local(n_tokens, rates, held))


def remote_seconds(n_tokens: int, size: StateSize, rates: Rates, *, held: int = 0) -> float:
    """Prefilling a state of `n_tokens` remotely, `held` of them already there, and handing all of it over."""
    return float(_remote(n_tokens, size, rates, held))


def remote_wins(n_tokens: int, size: StateSize, rates: Rates, *, local_held: int = 0, remote_held: int = 0) -> bool:
    """Whether prefilling a state of `n_tokens` remotely and handing it over is strictly faster (exactly), each
    side computing what it does not hold."""
    return _remote(n_tokens, size, rates, remote_held) < _local(n_tokens, rates, local_held)


def breakeven(size: StateSize, rates: Rates, *, local_held: int = 0, remote_held: int = 0) -> int | None:
    """The first state length (>= 1, and >= the longer holding) from which the remote path strictly wins for
    every longer one, or None when there is none.

    From the longer holding on, local - remote = n * slope - intercept, slope = 1/local - 1/remote -
    (1 - overlap) * per_token / link, intercept = local_held/local - remote_held/remote + (1 - overlap) *
    floor / link + fixed: the remote path wins for n > intercept / slope when the slope is positive, for every
    n when the slope is zero and the intercept negative (the remote side wins by what it holds), and not for
    every longer n otherwise."""
    if local_held < 0 or remote_held < 0:
        raise ValueError("token counts cannot be negative")
    exposed = 1 - _q(rates.overlap)
    link = _q(rates.link_bytes_per_s)
    local, remote = _q(rates.local_tokens_per_s), _q(rates.remote_tokens_per_s)
    slope = 1 / local - 1 / remote - exposed * _q(size.bytes_per_token) / link
    intercept = local_held / local - remote_held / remote + exposed * _q(size.floor_bytes) / link + _q(rates.fixed_s)
    if slope < 0 or (slope == 0 and intercept >= 0):
        return None
    if slope == 0:
        return max(1, local_held, remote_held)
    return max(1, local_held, remote_held, math.floor(intercept / slope) + 1)


@dataclass(frozen=True, slots=True)
class Decision:
    path: Literal["local", "disaggregated"]
    n_tokens: int  # the state's length
    local_s: float
    remote_s: float
    breakeven: int | None
    local_tokens: int = 0  # what each side computes: the state less what it holds
    remote_tokens: int = 0


def decide(n_tokens: int, size: StateSize, rates: Rates, *, local_held: int = 0, remote_held: int = 0) -> Decision:
    """Where to prefill a state of `n_tokens` (`local_held` of them held where it decodes, `remote_held` where
    it would be prefilled): remotely only when that strictly wins."""
    wins = remote_wins(n_tokens, size, rates, local_held=local_held, remote_held=remote_held)
    return Decision(
        path="disaggregated" if wins else "local",
        n_tokens=n_tokens,
        local_s=local_seconds(n_tokens, rates, held=local_held),
        remote_s=remote_seconds(n_tokens, size, rates, held=remote_held),
        breakeven=breakeven(size, rates, local_held=local_held, remote_held=remote_held),
        local_tokens=_to_compute(n_tokens, local_held),
        remote_tokens=_to_compute(n_tokens, remote_held),
    )


@dataclass(frozen=True, slots=True)
class Estimate:
    """A smoothed rate and how many samples it has seen."""

    value: float
    samples: int = 1


def observe(previous: Estimate | None, sample: float, *, alpha: float = 0.3) -> Estimate:
    """The EWMA after one more sample (the first sample is the estimate). Non-positive or non-finite samples
    (a timing of 0 ms, a failed probe) are ignored."""
    if not 0 < alpha <= 1:
        raise ValueError("alpha is in (0, 1]")
    if not (math.isfinite(sample) and sample > 0):
        return previous if previous is not None else Estimate(value=0.0, samples=0)
    if previous is None or previous.samples == 0:
        return Estimate(value=sample, samples=1)
    return Estimate(value=alpha * sample + (1 - alpha) * previous.value, samples=previous.samples + 1)


def rate(amount: float, seconds: float) -> float:
    """A rate from one measurement (tokens or bytes over seconds); 0 when the time is not positive."""
    return amount / seconds if seconds > 0 and math.isfinite(seconds) else 0.0


@dataclass(frozen=True, slots=True)
class Link:
    """A node pair's handoff cost: `fixed_s + bytes / bytes_per_s`."""

    bytes_per_s: float
    fixed_s: float = 0.0

    def seconds(self, n_bytes: float) -> float:
        return self.fixed_s + n_bytes / self.bytes_per_s


def fit_link(samples: Sequence[tuple[float, float]]) -> Link | None:
    """The least-squares line through (bytes, seconds) samples, with a positive rate and a fixed cost that is
    not negative; None without a usable sample. One size only (or a fit whose slope is not positive): the
    mean rate, no fixed cost. A negative intercept: the line through the origin."""
    usable = [(float(b), float(t)) for b, t in samples if b > 0 and t > 0 and math.isfinite(b) and math.isfinite(t)]
    if not usable:
        return None
    n = len(usable)
    mean_b = sum(b for b, _ in usable) / n
    mean_t = sum(t for _, t in usable) / n
    var = sum((b - mean_b) ** 2 for b, _ in usable)
    through_origin = Link(bytes_per_s=sum(b * b for b, _ in usable) / sum(b * t for b, t in usable))
    if var <= 0:
        return Link(bytes_per_s=mean_b / mean_t)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in usable) / var  # seconds per byte
    if slope <= 0:
        return Link(bytes_per_s=mean_b / mean_t)
    intercept = mean_t - slope * mean_b
    if intercept < 0:
        return through_origin
    return Link(bytes_per_s=1 / slope, fixed_s=intercept)
