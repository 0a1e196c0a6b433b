"""Phase placement cost model: prefill here, or prefill on a faster node and hand the state over (pure).

Rules this module keeps:

* Local time is `n / local_rate`. Remote time is `n / remote_rate` plus the part of the transfer that the
  remote prefill does not hide (`1 - overlap` of `state_bytes(n) / link_rate`: segments stream while later
  ones are still being prefilled) plus a fixed per-handoff cost (open, commit, restore).
* The state moved is `floor + bytes_per_token * n`: KV bytes per token from the memory model, and the
  recurrent floor of hybrid models, a constant state size whatever the token count (a pure recurrent model
  moves only the floor).
* Arithmetic is exact (`fractions.Fraction` of the float inputs), so a crossover that falls on an integer is
  found as that integer: break-even is the first token count that strictly wins, `floor(crossover) + 1`, never
  "none" because a float rounded the wrong way. Equal nodes never disaggregate: with the same prefill rate
  the transfer can only add time.
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


def _local(n: int, rates: Rates) -> Fraction:
    return Fraction(n) / _q(rates.local_tokens_per_s)


def _remote(n: int, size: StateSize, rates: Rates) -> Fraction:
    moved = _q(size.floor_bytes) + _q(size.bytes_per_token) * n
    exposed = (1 - _q(rates.overlap)) * moved / _q(rates.link_bytes_per_s)
    return Fraction(n) / _q(rates.remote_tokens_per_s) + exposed + _q(rates.fixed_s)


def local_seconds(n_tokens: int, rates: Rates) -> float:
    return float(_local(n_tokens, rates))


def remote_seconds(n_tokens: int, size: StateSize, rates: Rates) -> float:
    return float(_remote(n_tokens, size, rates))


def remote_wins(n_tokens: int, size: StateSize, rates: Rates) -> bool:
    """Whether prefilling `n_tokens` remotely and handing the state over is strictly faster (exactly)."""
    return _remote(n_tokens, size, rates) < _local(n_tokens, rates)


def breakeven(size: StateSize, rates: Rates) -> int | None:
    """The first token count (>= 1) from which the remote path strictly wins, or None when it never does.

    local - remote = n * slope - intercept, slope = 1/local - 1/remote - (1 - overlap) * per_token / link,
    intercept = (1 - overlap) * floor / link + fixed: the remote path wins for n > intercept / slope when the
    slope is positive, and never otherwise."""
    exposed = 1 - _q(rates.overlap)
    link = _q(rates.link_bytes_per_s)
    slope = (
        1 / _q(rates.local_tokens_per_s) - 1 / _q(rates.remote_tokens_per_s) - exposed * _q(size.bytes_per_token) / link
    )
    intercept = exposed * _q(size.floor_bytes) / link + _q(rates.fixed_s)
    if slope <= 0:
        return None
    return max(1, math.floor(intercept / slope) + 1)


@dataclass(frozen=True, slots=True)
class Decision:
    path: Literal["local", "disaggregated"]
    n_tokens: int
    local_s: float
    remote_s: float
    breakeven: int | None


def decide(n_tokens: int, size: StateSize, rates: Rates) -> Decision:
    """Where to prefill `n_tokens`: remotely only when that strictly wins."""
    wins = remote_wins(n_tokens, size, rates)
    return Decision(
        path="disaggregated" if wins else "local",
        n_tokens=n_tokens,
        local_s=local_seconds(n_tokens, rates),
        remote_s=remote_seconds(n_tokens, size, rates),
        breakeven=breakeven(size, rates),
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
