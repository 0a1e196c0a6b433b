"""When to add a replica of a catalog model and which to retire (`actors/frontdoor/scaling.py`, pure)."""

from __future__ import annotations

import msgspec
import pytest

from actors.frontdoor.scaling import FORGET, UP_HOLD_S, decide, expected_wait_s, replay, warm_nodes
from messages.frontdoor import ModelScale, Replica, ScaleMemory
from messages.l3 import L3Inventory, L3Item


def rep(iid: str, **fields: object) -> Replica:
    base: dict[str, object] = {"node": f"node-{iid}", "ready": True, "slots": 2,
                               "prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 50.0}  # fmt: skip
    return msgspec.convert({"instance_id": iid, **base, **fields}, Replica)


def model(*replicas: Replica, **rules: object) -> ModelScale:
    base: dict[str, object] = {"model": "m", "min_replicas": 0, "max_replicas": 2, "target_wait_s": 5.0,
                               "retire_idle_s": 30.0}  # fmt: skip
    return msgspec.convert({**base, **rules, "replicas": [msgspec.to_builtins(r) for r in replicas]}, ModelScale)


def busy(iid: str, prompt: int, generation: int) -> Replica:
    return rep(iid, busy=2, queued=4, queued_prompt_tokens=prompt, queued_generation_tokens=generation)


def test_the_expected_wait_is_queued_prompts_over_prefill_plus_generation_over_the_slots_decode() -> None:
    assert expected_wait_s(rep("a")) == 0.0
    assert expected_wait_s(busy("a", 2000, 400)) == pytest.approx(2000 / 1000 + 400 / (50 * 2))
    assert expected_wait_s(rep("a", queued=3, prefill_tokens_per_s=0.0)) is None  # nothing measured yet


def test_a_replica_is_added_once_the_wait_stayed_over_the_target_for_the_hold() -> None:
    scale = model(busy("a", 4000, 400))  # 4 + 4 = 8 s over a 5 s target
    first = decide(scale, FORGET, now=100.0)
    assert first.action == "hold" and first.memory.over_since == 100.0 and first.expected_wait_s == pytest.approx(8)
    again = decide(scale, first.memory, now=100.0 + UP_HOLD_S / 2)
    assert again.action == "hold" and again.memory.over_since == 100.0
    added = decide(scale, again.memory, now=100.0 + UP_HOLD_S)
    assert added.action == "add" and "over the target" in added.reason and added.memory == FORGET


def test_a_blip_under_the_target_forgets_the_wait() -> None:
    over = decide(model(busy("a", 4000, 400)), FORGET, now=100.0)
    calm = decide(model(rep("a", busy=2)), over.memory, now=101.0)
    assert calm.action == "hold" and calm.memory == FORGET
    assert decide(model(busy("a", 4000, 400)), calm.memory, now=102.0).memory.over_since == 102.0


def test_no_addition_beyond_the_maximum_or_while_one_starts_or_on_a_guess() -> None:
    long_ago = ScaleMemory(over_since=0.0)
    assert decide(model(busy("a", 9000, 900), max_replicas=1), long_ago, now=100.0).action == "hold"
    starting = rep("b", ready=False)
    assert decide(model(busy("a", 9000, 900), starting), long_ago, now=100.0).action == "hold"
    unmeasured = rep("a", busy=2, queued=50, queued_prompt_tokens=10**6, prefill_tokens_per_s=0.0)
    assert decide(model(unmeasured), long_ago, now=100.0).action == "hold"
    # the least-waiting replica decides: one idle replica means a new request does not wait
    assert decide(model(busy("a", 9000, 900), rep("b"), max_replicas=3), long_ago, now=100.0).action == "hold"


def test_min_replicas_are_kept_whatever_the_load() -> None:
    decision = decide(model(min_replicas=1), FORGET, now=0.0)
    assert decision.action == "add" and "min_replicas" in decision.reason
    assert decide(model(rep("a", ready=False), min_replicas=1), FORGET, now=0.0).action == "hold"
    idle_long = rep("a", idle_s=10_000.0)
    assert decide(model(idle_long, min_replicas=1), FORGET, now=0.0).action == "hold"  # not retired below it


def test_the_replica_idle_longest_is_retired_never_one_working_or_while_any_waits() -> None:
    a, b = rep("a", idle_s=40.0, resident_tokens=100), rep("b", idle_s=90.0, resident_tokens=5000)
    decision = decide(model(a, b), FORGET, now=0.0)
    assert decision.action == "retire" and decision.retire == "b"
    assert decide(model(rep("a", idle_s=20.0), rep("b", idle_s=25.0)), FORGET, now=0.0).action == "hold"
    assert decide(model(rep("a", idle_s=90.0, busy=1), rep("b", busy=2)), FORGET, now=0.0).action == "hold"
    assert decide(model(rep("a", idle_s=90.0), busy("b", 10, 10)), FORGET, now=0.0).action == "hold"
    assert decide(model(rep("a", idle_s=90.0)), FORGET, now=0.0).action == "hold"  # the last one stays
    tie = decide(model(rep("a", idle_s=50.0, resident_tokens=9), rep("b", idle_s=50.0, resident_tokens=1)), FORGET, 0)
    assert tie.retire == "b"  # equally idle: the one holding less goes


def test_over_the_maximum_an_idle_one_goes_at_once() -> None:
    decision = decide(model(rep("a"), rep("b", idle_s=1.0), max_replicas=1), FORGET, now=0.0)
    assert decision.action == "retire" and decision.retire == "b"


def test_replay_re_decides_the_same_and_names_a_difference() -> None:
    scale, memory = model(busy("a", 4000, 400)), ScaleMemory(over_since=10.0)
    recorded = decide(scale, memory, now=20.0)
    assert recorded.action == "add" and replay(scale, memory, 20.0, recorded) == []
    forged = msgspec.structs.replace(recorded, action="hold")
    assert replay(scale, memory, 20.0, forged) == [("action", "hold", "add")]


def test_a_new_replica_prefers_the_nodes_whose_stores_hold_most_of_the_models_states() -> None:
    def store(node: str, *items: tuple[str, int]) -> L3Inventory:
        held = tuple(L3Item(identity=i, n_tokens=n, entry=f"{k:064x}", bytes=n) for k, (i, n) in enumerate(items))
        return L3Inventory(node_id=node, entries=len(held), tokens=0, bytes=0, budget_bytes=1, items=held)

    ours, other = "a" * 64, "b" * 64
    stores = [
        store("n-10", (ours, 300)),
        store("n-2", (ours, 100), (ours, 200)),  # 300 as well: natural order breaks the tie
        store("n-3", (other, 5000)),  # another model's states count for nothing
        store("n-4", (ours, 9000)),  # the most, but already runs a replica (not a candidate)
        store("n-5", (ours, 50)),
    ]
    assert warm_nodes(stores, {ours}, {"n-10", "n-2", "n-3", "n-5", "n-6"}) == ("n-2", "n-10", "n-5")
    assert warm_nodes(stores, set(), {"n-2"}) == ()
