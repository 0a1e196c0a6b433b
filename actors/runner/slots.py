"""The slots of one llama-server instance: which is free, and which tokens each one holds (runner core, pure).

Rules this module keeps:

* A request gets a free slot or waits; `acquire` never hands out a busy slot, and every acquired slot is
  given back exactly once (`release`), with the tokens the server's cache holds for it afterwards.
* Among free slots, the one whose held tokens share the longest prefix with the request wins (the server
  then reuses that prefix); ties go to the least recently used slot (its contents are the least likely to
  be wanted again), then to the lowest id. On a model whose state cannot be rolled back (recurrent layers:
  `rollback=False`), a slot is credited only when everything it holds is a prefix of the request: one
  holding more would be re-evaluated from the start by the server. A slot whose state is unknown (the
  server restarted, a request failed) holds nothing.
* Waiting requests are served in the order of `fairqueue.FairQueue` (priority class, then weighted fair
  queueing across tenants by token cost; one tenant alone: arrival order): a release hands the slot to its head.
* A busy slot that is only finishing (its answer sent, its state being captured: `finishing`) is worth waiting
  for when it holds at least `wait_gain` more tokens of the request than the best free slot: the next turn of
  a conversation, sent as soon as its answer arrived, then extends its own prefix instead of starting cold.
* Prompt states are reused within a cache scope only: a slot that last held another scope's state counts for
  nothing and is erased before use (`Grant.foreign`). llama-server's host-memory prompt cache (`--cache-ram`,
  `prompt_cache=True`) is one for all its slots, and the server loads from it whatever cached prompt matches
  best, of any scope: so on such an instance a request may reuse anything (`Grant.reuse`, sent as
  `cache_prompt`) only while every request the server has served since it started was of the request's own
  scope. Once two scopes met there, none reuses until the server restarts (`forget`); give a node that serves
  several tenants `--cache-ram 0` to keep reuse within each scope.
* No clock and no I/O: "recently" is a counter of releases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actors.runner.fairqueue import Claim, FairQueue, Waiter

__all__ = ["Grant", "PromptLimit", "SlotTable", "common_prefix", "oversize"]

#: A request that names no tenant, class or cost (tests, probes): the default class, one token.
ANYONE = Claim()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class PromptLimit:
    """What a slot of an instance can hold: `n_ctx_seq` tokens, each covering at most `longest_token_bytes` of text
    (the vocabulary's longest token). 0: not known, nothing refused."""

    n_ctx_seq: int = 0
    longest_token_bytes: int = 0


def oversize(
    limit: PromptLimit, *, text: str | None = None, tokens: int | None = None, text_bytes: int | None = None
) -> tuple[str, dict[str, int]] | None:
    """Why a prompt can never fit its slot (a message and details), or None: token ids over the context, or text
    longer than the context's tokens could cover (tokenizing a megabyte costs a server a minute of both cores)."""
    if limit.n_ctx_seq and tokens is not None and tokens > limit.n_ctx_seq:
        why = f"the prompt has {tokens} tokens, over the context of {limit.n_ctx_seq}"
        return why, {"n_prompt_tokens": tokens, "n_ctx": limit.n_ctx_seq}
    if text is not None:
        text_bytes = len(text.encode("utf-8", errors="surrogatepass"))
    if limit.n_ctx_seq and limit.longest_token_bytes and text_bytes is not None:
        most = limit.n_ctx_seq * limit.longest_token_bytes
        size = text_bytes
        if size > most:
            why = (f"the prompt is {size} bytes: its context of {limit.n_ctx_seq} tokens holds at most {most} bytes "
                   f"of text (no token covers more than {limit.longest_token_bytes})")  # fmt: skip
            return why, {"prompt_bytes": size, "n_ctx": limit.n_ctx_seq}
    return None


class Grant:
    """A slot handed to one request, and the prefix the server already holds for it. `foreign`: the slot holds
    another cache scope's state, which is erased before the request uses it. `reuse`: whether the server may
    reuse any cached prompt for it (its `cache_prompt`; false once the instance's prompt cache held two scopes)."""

    __slots__ = ("foreign", "resident", "reuse", "slot")

    def __init__(self, slot: int, resident: int, foreign: bool = False, reuse: bool = True) -> None:
        self.slot = slot
        self.resident = resident
        self.foreign = foreign
        self.reuse = reuse

    def __repr__(self) -> str:
        return f"Grant(slot={self.slot}, resident={self.resident}, foreign={self.foreign}, reuse={self.reuse})"


class SlotTable:
    def __init__(
        self, n_slots: int, *, rollback: bool = True, wait_gain: int = 256, prompt_cache: bool = False
    ) -> None:
        """`prompt_cache`: the server keeps a host-memory prompt cache shared by its slots (`--cache-ram` not 0)."""
        if n_slots < 1:
            raise ValueError("an instance has at least one slot")
        self.rollback = rollback
        self.wait_gain = wait_gain
        self.prompt_cache = prompt_cache
        self._served: set[str] = set()  # the scopes granted since the server started
        self._held: list[tuple[int, ...]] = [() for _ in range(n_slots)]
        # the cache scope whose state each slot's server cache may hold (the last it was granted to; None: nothing
        # since the server started): what it holds is another scope's even when the table does not know the tokens
        self._scope: list[str | None] = [None] * n_slots
        self._busy = [False] * n_slots
        self._finishing = [False] * n_slots
        self._used = [0] * n_slots  # release counter at last release: lower is older
        self._clock = 0
        self._waiting: FairQueue[object] = FairQueue()

    @property
    def n_slots(self) -> int:
        return len(self._held)

    @property
    def busy(self) -> int:
        return sum(self._busy)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def held(self, slot: int) -> tuple[int, ...]:
        return self._held[slot]

    def holdings(self) -> list[tuple[int, ...]]:
        """What every slot holds (busy ones included: their prefix stays while they run)."""
        return list(self._held)

    def waiters(self) -> list[tuple[object, Waiter]]:
        """Who waits, in the order they would get a slot."""
        return self._waiting.waiters()

    def wait(self, ticket: object, claim: Claim = ANYONE) -> Waiter:
        """Queues a request that found no free slot (or arrived behind others)."""
        return self._waiting.arrive(ticket, claim)

    def withdraw(self, ticket: object) -> None:
        """A waiting request gave up (deadline, client gone)."""
        self._waiting.withdraw(ticket)

    def my_turn(self, ticket: object) -> bool:
        """Whether `ticket` may take a slot now: it is the queue's head (or nobody waits) and a slot is free."""
        if not self.free():
            return False
        head = self._waiting.head()
        return head is None or head is ticket

    def free(self) -> bool:
        return not all(self._busy)

    def acquire(
        self, tokens: Sequence[int], ticket: object | None = None, claim: Claim = ANYONE, scope: str = ""
    ) -> Grant | None:
        """The best free slot for `tokens`, marked busy; None when every slot is busy or others wait first.
        `ticket`: a waiter's (its claim was given to `wait`); else `claim` is the request's, served at once.
        `scope`: the request's cache scope: only a slot holding that scope's state counts what it holds."""
        if ticket is None and self._waiting:
            return None
        if ticket is not None and not self.my_turn(ticket):
            return None
        best: tuple[int, int, int] | None = None  # (-shared prefix, last used, slot)
        finishing = 0  # the most a finishing slot could reuse
        for slot, busy in enumerate(self._busy):
            if busy:
                if self._finishing[slot]:
                    finishing = max(finishing, self.reusable(slot, tokens, scope))
                continue
            key = (-self.reusable(slot, tokens, scope), self._used[slot], slot)
            if best is None or key < best:
                best = key
        if best is None or finishing - -best[0] >= self.wait_gain:
            return None
        if ticket is not None:
            self._waiting.take(ticket)
        else:
            self._waiting.served_at_once(claim)
        slot = best[2]
        self._busy[slot] = True
        foreign = self._scope[slot] not in (None, scope)
        self._scope[slot] = scope
        reuse = self.reuses(scope)
        self._served.add(scope)
        return Grant(slot, -best[0] if reuse else 0, foreign, reuse)

    def reuses(self, scope: str) -> bool:
        """Whether a request of `scope` may reuse cached prompts: always without a shared prompt cache; with one,
        only while the server has served no other scope since it started."""
        return not self.prompt_cache or self._served <= {scope}

    def reusable(self, slot: int, tokens: Sequence[int], scope: str = "") -> int:
        """How many leading tokens of `tokens` the server can reuse from what `slot` holds (none of another cache
        scope's state)."""
        if self._scope[slot] not in (None, scope) or not self.reuses(scope):
            return 0
        held = self._held[slot]
        shared = common_prefix(held, tokens)
        if not self.rollback and shared < len(held):
            return 0
        return shared

    def update(self, slot: int, tokens: Sequence[int]) -> None:
        """What the server holds for a busy slot now (after a restore or a prefill)."""
        if not self._busy[slot]:
            raise ValueError(f"slot {slot} is not acquired")
        self._held[slot] = tuple(tokens)

    def finishing(self, slot: int, tokens: Sequence[int]) -> None:
        """A busy slot's answer is done and only its capture runs: it holds `tokens` and is given back soon."""
        self.update(slot, tokens)
        self._finishing[slot] = True

    def release(self, slot: int, tokens: Sequence[int] | None) -> None:
        """Gives a slot back; `tokens` is what the server's cache holds for it now (None: unknown)."""
        if not self._busy[slot]:
            raise ValueError(f"slot {slot} is not acquired")
        self._busy[slot] = False
        self._finishing[slot] = False
        self._held[slot] = tuple(tokens) if tokens is not None else ()
        self._clock += 1
        self._used[slot] = self._clock

    def forget(self) -> None:
        """The server restarted: no slot holds anything (busy slots stay busy until released)."""
        self._held = [() for _ in self._held]
        self._scope = [None] * len(self._scope)
        self._served.clear()
