"""The order in which an instance's waiting requests get a slot (runner core, pure): priority classes first, and
within a class weighted fair queueing across tenants by token cost.

Rules this module keeps:

* A request of a higher `priority` goes before every request of a lower one that waits with it. A lower class
  is served whenever no higher one waits (nothing idles while anyone waits: the queue only orders).
* Within a class, start-time fair queueing (Goyal et al., 1996) by token cost: each request is tagged on arrival
  with `start = max(V, F[tenant])` and `finish = start + cost / weight`, where `V` is the class's virtual time
  (the start tag of the request last given a slot) and `F[tenant]` the finish tag of the tenant's previous
  request; the waiter with the smallest finish tag goes first (ties: arrival). A tenant's tags advance by its
  own cost, so one with 100 long prompts queued is behind one that just sent a short one, and a tenant that
  waited long is not owed a burst: a newcomer starts at `V`, not at zero.
* A request given a slot at once (nobody waiting) is tagged too: what a tenant used while alone counts.
* Cost is tokens (prompt + expected generation, at least 1); weight is the tenant's share (> 0).
* Everything a decision used is in `Tags` and `Waiter`: `choose` re-decides a grant from what the journal
  recorded, and `tag` a waiter's tags from its inputs (replay).
* Memory is bounded: tenants behind the clock are forgotten, and at most `MAX_REMEMBERED` are remembered.
* No clock and no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from messages.events import QueuedWaiter
from messages.generate import GenerateRequest

__all__ = [
    "DEFAULT_GENERATION_COST",
    "MAX_REMEMBERED",
    "Claim",
    "FairQueue",
    "Tags",
    "Waiter",
    "choose",
    "claim_of",
    "rechoose",
    "retag",
    "tag",
]

#: Tenants whose last finish tag is remembered per instance; beyond it the earliest are forgotten (they are the
#: nearest to the clock, so forgetting them moves their next start least).
MAX_REMEMBERED = 4096

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Claim:
    """Who asks, in which class, at what share, for how many tokens."""

    tenant: str = ""
    priority: int = 0
    weight: float = 1.0
    cost: int = 1
    prompt_tokens: int = 0  # of `cost`, the prompt's (the rest: what it may generate); not in the tags' rules

    def __post_init__(self) -> None:
        if self.weight <= 0 or self.cost < 1 or not 0 <= self.prompt_tokens <= self.cost:
            raise ValueError(f"a claim has a positive weight and cost (got {self.weight}, {self.cost})")


@dataclass(frozen=True, slots=True)
class Tags:
    seq: int  # arrival order on this instance
    virtual: float  # the class's virtual time at arrival
    previous: float  # the tenant's last finish tag at arrival (0: none)
    start: float
    finish: float


@dataclass(frozen=True, slots=True)
class Waiter:
    claim: Claim
    tags: Tags

    @property
    def order(self) -> tuple[int, float, int]:
        """Smaller goes first: higher class, then earlier finish tag, then earlier arrival."""
        return (-self.claim.priority, self.tags.finish, self.tags.seq)


#: The tokens a request that names no bound on its generation is expected to generate, for its queue cost (tags
#: are set on arrival, before anything is generated: the cost is an estimate, the prompt exact).
DEFAULT_GENERATION_COST = 256


def claim_of(request: GenerateRequest, prompt_tokens: int, max_generated: int | None) -> Claim:
    """The queue's claim of `request`: its tenant, class and share, costing its prompt and what it may generate
    (`max_generated`: its bound, None when it names none)."""
    generated = max_generated if max_generated is not None else DEFAULT_GENERATION_COST
    cost = max(1, prompt_tokens + min(generated, 1 << 20))
    return Claim(
        tenant=request.tenant, priority=request.priority, weight=request.weight, cost=cost,
        prompt_tokens=min(prompt_tokens, cost),
    )  # fmt: skip


def tag(claim: Claim, seq: int, virtual: float, previous: float) -> Tags:
    start = max(virtual, previous)
    return Tags(seq=seq, virtual=virtual, previous=previous, start=start, finish=start + claim.cost / claim.weight)


def choose(waiters: Iterable[Waiter]) -> Waiter | None:
    """The waiter that goes next, or None when nobody waits."""
    return min(waiters, key=lambda w: w.order, default=None)


class FairQueue(Generic[K]):
    """The waiting requests of one instance, by key."""

    def __init__(self) -> None:
        self._waiting: dict[K, Waiter] = {}
        self._virtual: dict[int, float] = {}  # class -> virtual time
        self._finish: dict[tuple[int, str], float] = {}  # (class, tenant) -> its last finish tag
        self._seq = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def waiters(self) -> list[tuple[K, Waiter]]:
        """Everyone waiting, in the order they would be served."""
        return sorted(self._waiting.items(), key=lambda kw: kw[1].order)

    def _tag(self, claim: Claim) -> Tags:
        self._seq += 1
        virtual = self._virtual.get(claim.priority, 0.0)
        tags = tag(claim, self._seq, virtual, self._finish.get((claim.priority, claim.tenant), 0.0))
        self._finish[(claim.priority, claim.tenant)] = tags.finish
        if len(self._finish) > MAX_REMEMBERED:
            for entry, _ in sorted(self._finish.items(), key=lambda e: e[1])[: len(self._finish) // 4]:
                del self._finish[entry]
        return tags

    def arrive(self, key: K, claim: Claim) -> Waiter:
        """`key` waits for a slot."""
        if key in self._waiting:
            raise ValueError(f"{key!r} already waits")
        waiter = Waiter(claim, self._tag(claim))
        self._waiting[key] = waiter
        return waiter

    def served_at_once(self, claim: Claim) -> Tags:
        """A request got a slot without waiting: its tenant's tags still advance, and the class's clock."""
        tags = self._tag(claim)
        self._advance(claim.priority, tags.start)
        return tags

    def head(self) -> K | None:
        """The key that goes next, or None when nobody waits."""
        best: tuple[tuple[int, float, int], K] | None = None
        for key, waiter in self._waiting.items():
            if best is None or waiter.order < best[0]:
                best = (waiter.order, key)
        return best[1] if best is not None else None

    def take(self, key: K) -> Waiter:
        """`key` got its slot: it leaves the queue, and its class's virtual time moves to its start tag."""
        waiter = self._waiting.pop(key)
        self._advance(waiter.claim.priority, waiter.tags.start)
        return waiter

    def withdraw(self, key: K) -> None:
        """`key` gave up waiting (deadline, client gone). Its tenant's tags keep its cost: a tenant that keeps
        abandoning work does not jump ahead of the others."""
        self._waiting.pop(key, None)

    def _advance(self, priority: int, start: float) -> None:
        virtual = max(self._virtual.get(priority, 0.0), start)
        self._virtual[priority] = virtual
        # A tenant whose last finish the clock has passed would start at the clock anyway: forget it (bounded).
        for entry in [e for e, f in self._finish.items() if e[0] == priority and f <= virtual]:
            del self._finish[entry]


# --- replay: the journal's records re-decided with today's rules ---------------------------------------------


def _waiter(recorded: QueuedWaiter) -> Waiter:
    claim = Claim(tenant=recorded.tenant, priority=recorded.priority, weight=recorded.weight, cost=recorded.cost)
    tags = Tags(seq=recorded.seq, virtual=recorded.virtual, previous=recorded.previous, start=recorded.start,
                finish=recorded.finish)  # fmt: skip
    return Waiter(claim, tags)


def retag(recorded: QueuedWaiter) -> Tags:
    """The tags today's rules give the recorded waiter's claim from the recorded inputs (class clock, tenant's
    last finish): equal to what was recorded unless the rules changed."""
    waiter = _waiter(recorded)
    return tag(waiter.claim, recorded.seq, recorded.virtual, recorded.previous)


def rechoose(candidates: Iterable[QueuedWaiter]) -> str | None:
    """The request today's rules give the slot among the recorded candidates (its request id)."""
    by_waiter = {_waiter(c): c.request_id for c in candidates}
    chosen = choose(by_waiter)
    return by_waiter[chosen] if chosen is not None else None
