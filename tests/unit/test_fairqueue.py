"""The runner's queue order (`actors/runner/fairqueue.py`, pure), alone and under the real `SlotTable`: priority
classes, weighted fair queueing by token cost across tenants, work conservation, and replay of every decision."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import pytest

from actors.runner.fairqueue import MAX_REMEMBERED, Claim, FairQueue, Waiter, choose, tag
from actors.runner.slots import SlotTable


def test_one_tenant_alone_is_served_in_arrival_order() -> None:
    queue: FairQueue[int] = FairQueue()
    for i, cost in enumerate([500, 10, 90, 1, 7000]):
        queue.arrive(i, Claim(tenant="a", cost=cost))
    order = []
    while (head := queue.head()) is not None:
        queue.take(head)
        order.append(head)
    assert order == [0, 1, 2, 3, 4]


def test_a_higher_class_goes_first_and_a_lower_one_when_none_waits() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.arrive("low-1", Claim(tenant="a", priority=0, cost=1))
    queue.arrive("high-1", Claim(tenant="b", priority=5, cost=10_000))
    queue.arrive("low-2", Claim(tenant="c", priority=0, cost=1))
    queue.arrive("high-2", Claim(tenant="b", priority=5, cost=10_000))
    served = []
    while (head := queue.head()) is not None:
        served.append(queue.take(head))
        if head == "high-1":
            queue.arrive("mid", Claim(tenant="d", priority=3, cost=1))
    assert [w.claim.priority for w in served] == [5, 5, 3, 0, 0]


def test_a_short_request_goes_before_a_flooding_tenants_backlog() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.arrive(f"a{i}", Claim(tenant="a", cost=2000))
    queue.take("a0")  # one of a's runs
    queue.arrive("b0", Claim(tenant="b", cost=40))
    assert queue.head() == "b0"


def test_a_tenant_that_waited_long_is_not_owed_a_burst() -> None:
    """A newcomer starts at the class's clock, not at zero: b, back after a's long run alone, alternates with a."""
    queue: FairQueue[str] = FairQueue()
    for _ in range(50):  # a alone, served as it arrives
        queue.served_at_once(Claim(tenant="a", cost=100))
    for i in range(4):
        queue.arrive(f"a{i}", Claim(tenant="a", cost=100))
        queue.arrive(f"b{i}", Claim(tenant="b", cost=100))
    order = []
    while (head := queue.head()) is not None:
        queue.take(head)
        order.append(head[0])
    assert order[:2] == ["b", "a"] or order[:2] == ["a", "b"]
    assert order.count("b") == 4 and "bbb" not in "".join(order)


def test_weights_share_service_in_their_ratio_while_both_are_backlogged() -> None:
    queue: FairQueue[tuple[str, int]] = FairQueue()
    weights = {"heavy": 3.0, "light": 1.0}
    for i in range(400):
        for tenant, weight in weights.items():
            queue.arrive((tenant, i), Claim(tenant=tenant, weight=weight, cost=50))
    first = [queue.take(h) for h in itertools.islice(iter(queue.head, None), 200)]
    heavy = sum(1 for w in first if w.claim.tenant == "heavy")
    assert heavy == pytest.approx(150, abs=2)


def test_a_withdrawn_head_hands_the_turn_to_the_next_and_keeps_its_tenants_cost() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.arrive("a1", Claim(tenant="a", cost=100))
    queue.arrive("b1", Claim(tenant="b", cost=150))
    queue.withdraw("a1")
    queue.withdraw("a1")  # twice: nothing
    assert queue.head() == "b1" and len(queue) == 1
    queue.arrive("a2", Claim(tenant="a", cost=100))
    assert queue.head() == "b1"  # a's abandoned request still counts: a2 finishes at 200, b1 at 150


def test_forgotten_tenants_are_bounded_by_the_ones_ahead_of_the_clock() -> None:
    queue: FairQueue[int] = FairQueue()
    for i in range(3 * MAX_REMEMBERED):
        queue.served_at_once(Claim(tenant=f"t{i}", cost=1 + i % 7))
    assert len(queue._finish) <= MAX_REMEMBERED
    queue.served_at_once(Claim(tenant="late", cost=50))  # a tenant further ahead than most is remembered
    assert (0, "late") in queue._finish


def test_bad_claims_are_refused() -> None:
    with pytest.raises(ValueError):
        Claim(weight=0)
    with pytest.raises(ValueError):
        Claim(cost=0)
    queue: FairQueue[str] = FairQueue()
    queue.arrive("x", Claim())
    with pytest.raises(ValueError):
        queue.arrive("x", Claim())


# --- under the real slot table: a discrete-event run, service time proportional to cost ---------------------


@dataclass
class Run:
    slots: int
    table: SlotTable = field(init=False)
    now: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)
    idle_while_waiting: float = 0.0
    decisions: list[tuple[list[Waiter], Waiter]] = field(default_factory=list)
    arrivals: list[Waiter] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.table = SlotTable(self.slots)

    def serve(self, requests: list[tuple[float, str, Claim]]) -> None:
        """`requests`: (arrival time, name, claim). Runs until every request finished."""
        pending = sorted(requests, key=lambda r: r[0])
        running: list[tuple[float, int, str]] = []  # (end, slot, name)
        waiting: dict[str, Claim] = {}
        i = 0
        while i < len(pending) or running or waiting:
            next_arrival = pending[i][0] if i < len(pending) else float("inf")
            next_end = running[0][0] if running else float("inf")
            step = min(next_arrival, next_end)
            free = self.slots - len(running)
            if waiting and free:
                self.idle_while_waiting += (step - self.now) * free
            self.now = step
            if next_end <= next_arrival:
                _, slot, name = heapq.heappop(running)
                self.finished[name] = self.now
                self.table.release(slot, None)
            else:
                _, name, claim = pending[i]
                i += 1
                grant = self.table.acquire((), None, claim)
                if grant is not None:
                    heapq.heappush(running, (self.now + claim.cost / 1000, grant.slot, name))
                    continue
                self.arrivals.append(self.table.wait(name, claim))
                waiting[name] = claim
            while waiting and self.table.free():  # what every woken waiter does: its turn, then its slot
                before = self.table.waiters()
                head = next(n for n in waiting if self.table.my_turn(n))
                grant = self.table.acquire((), head)
                assert grant is not None
                self.decisions.append(([w for _, w in before], before[0][1]))
                heapq.heappush(running, (self.now + waiting.pop(head).cost / 1000, grant.slot, head))


def flood(with_short: bool) -> Run:
    """Tenant a floods 50 long requests at t=0; b sends 5 short ones a little later, on 2 slots."""
    requests = [(0.0, f"a{i}", Claim(tenant="a", cost=2000)) for i in range(50)]
    if with_short:
        requests += [(0.5 + 0.1 * i, f"b{i}", Claim(tenant="b", cost=100)) for i in range(5)]
    run = Run(slots=2)
    run.serve(requests)
    return run


def test_the_short_tenant_finishes_before_the_flood_drains_and_no_slot_idles_while_anyone_waits() -> None:
    run = flood(with_short=True)
    last_b = max(t for n, t in run.finished.items() if n.startswith("b"))
    a_after_b = [n for n, t in run.finished.items() if n.startswith("a") and t > last_b]
    assert len(a_after_b) >= 40, a_after_b  # b's five were served within the first few of a's fifty
    assert last_b < 8.0  # each of b's waited at most for one of a's running (2 s) requests
    assert run.idle_while_waiting == 0.0
    assert len(run.finished) == 55


def test_every_grant_and_every_tag_replays_to_the_same_decision() -> None:
    run = flood(with_short=True)
    assert run.decisions
    for candidates, chosen in run.decisions:
        assert choose(candidates) == chosen
    for waiter in run.arrivals:
        t = waiter.tags
        assert tag(waiter.claim, t.seq, t.virtual, t.previous) == t
