"""The per-key limits core: token buckets for requests and tokens per minute, leases for concurrency."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages.tenants import TenantKey
from runtime.key_limits import KeyState, Lease, Level, Refused, admit, advance, expires_in, limited, settle, take

T0 = 1_700_000_000.0
LEASE = 15.0


def key(*, rpm: int | None = None, tpm: int | None = None, max_concurrent: int | None = None) -> TenantKey:
    return TenantKey(
        key_id="0123456789abcdef", tenant="acme", secret_sha256="0" * 64, created_at=T0,
        rpm=rpm, tpm=tpm, max_concurrent=max_concurrent,
    )  # fmt: skip


def admit_n(state: KeyState | None, k: TenantKey, now: float, *, node: str = "a", in_flight: int = 0) -> KeyState:
    verdict = admit(state, k, node=node, in_flight=in_flight, tokens=0, now=now, lease_s=LEASE)
    assert isinstance(verdict, KeyState), verdict
    return verdict


def test_a_bucket_starts_full_and_refills_at_its_rate_up_to_its_capacity() -> None:
    assert advance(None, 60, T0) == Level(level=60.0, at=T0)
    assert advance(Level(level=0.0, at=T0), 60, T0 + 10) == Level(level=10.0, at=T0 + 10)
    assert advance(Level(level=0.0, at=T0), 60, T0 + 3600).level == 60.0


def test_a_clock_behind_the_bucket_refills_nothing() -> None:
    bucket = Level(level=5.0, at=T0)
    assert advance(bucket, 60, T0 - 30) == bucket


def test_take_says_how_long_until_the_floor_when_it_cannot() -> None:
    assert take(Level(level=1.0, at=T0), 60, T0, 1.0, floor=1.0) == Level(level=0.0, at=T0)
    assert take(Level(level=0.5, at=T0), 60, T0, 1.0, floor=1.0) == pytest.approx(0.5)


def test_rpm_admits_its_count_then_refuses_naming_the_limit_with_retry_after() -> None:
    k = key(rpm=3)
    state = None
    for _ in range(3):
        state = admit_n(state, k, T0)
    refused = admit(state, k, node="a", in_flight=0, tokens=0, now=T0, lease_s=LEASE)
    assert isinstance(refused, Refused)
    assert refused.limit == "rpm" and refused.retry_after_s == 20  # one token every 20 s
    assert "requests per minute" in refused.message and "rpm" in refused.message
    assert isinstance(admit(state, k, node="a", in_flight=0, tokens=0, now=T0 + 20, lease_s=LEASE), KeyState)


def test_rpm_is_shared_by_every_front_door_writing_the_same_record() -> None:
    k = key(rpm=3)
    state = admit_n(None, k, T0, node="a")
    state = admit_n(state, k, T0, node="b")
    state = admit_n(state, k, T0, node="a")
    assert isinstance(admit(state, k, node="b", in_flight=0, tokens=0, now=T0, lease_s=LEASE), Refused)


def test_tpm_charges_after_the_answer_into_debt_and_refuses_until_refilled() -> None:
    k = key(tpm=600)  # 10 tokens a second
    state = admit_n(None, k, T0)  # nothing taken at admission
    assert state.tpm == Level(level=600.0, at=T0)
    state = settle(state, k, node="a", in_flight=0, tokens=700, now=T0, lease_s=LEASE)  # 100 over
    assert state.tpm is not None and state.tpm.level == -100.0
    refused = admit(state, k, node="a", in_flight=0, tokens=0, now=T0 + 1, lease_s=LEASE)
    assert isinstance(refused, Refused) and refused.limit == "tpm"
    assert refused.retry_after_s == 9  # 90 tokens of debt left at 10 a second
    assert isinstance(admit(state, k, node="a", in_flight=0, tokens=0, now=T0 + 10, lease_s=LEASE), KeyState)


def test_tokens_not_yet_charged_count_at_the_next_admission() -> None:
    k = key(tpm=60)
    verdict = admit(None, k, node="a", in_flight=0, tokens=61, now=T0, lease_s=LEASE)
    assert isinstance(verdict, Refused) and verdict.limit == "tpm" and verdict.retry_after_s == 1


def test_concurrency_sums_every_front_doors_unexpired_lease() -> None:
    k = key(max_concurrent=2)
    state = admit_n(None, k, T0, node="a")
    assert state.doors == {"a": Lease(n=1, until=T0 + LEASE)}
    state = admit_n(state, k, T0, node="b")
    refused = admit(state, k, node="a", in_flight=1, tokens=0, now=T0, lease_s=LEASE)
    assert isinstance(refused, Refused) and refused.limit == "max_concurrent" and refused.retry_after_s == 1
    released = settle(state, k, node="b", in_flight=0, tokens=0, now=T0, lease_s=LEASE)
    assert released.doors == {"a": Lease(n=1, until=T0 + LEASE)}
    assert isinstance(admit(released, k, node="a", in_flight=1, tokens=0, now=T0, lease_s=LEASE), KeyState)


def test_a_front_door_that_stops_renewing_stops_counting_when_its_lease_ends() -> None:
    k = key(max_concurrent=1)
    state = admit_n(None, k, T0, node="crashed")
    assert isinstance(admit(state, k, node="b", in_flight=0, tokens=0, now=T0 + LEASE - 1, lease_s=LEASE), Refused)
    assert isinstance(admit(state, k, node="b", in_flight=0, tokens=0, now=T0 + LEASE + 0.1, lease_s=LEASE), KeyState)


def test_the_longest_refusal_is_named() -> None:
    k = key(rpm=1, tpm=60, max_concurrent=1)
    state = admit_n(None, k, T0)
    state = settle(state, k, node="a", in_flight=1, tokens=600, now=T0, lease_s=LEASE)  # 540 over: 540 s
    refused = admit(state, k, node="a", in_flight=1, tokens=0, now=T0, lease_s=LEASE)
    assert isinstance(refused, Refused) and refused.limit == "tpm" and refused.retry_after_s == 540


def test_limits_the_key_no_longer_has_are_dropped_from_its_record() -> None:
    state = admit_n(None, key(rpm=5, tpm=100, max_concurrent=2), T0)
    now_unlimited = settle(state, key(rpm=5), node="a", in_flight=1, tokens=10, now=T0, lease_s=LEASE)
    assert now_unlimited.tpm is None and now_unlimited.doors == {} and now_unlimited.rpm is not None


def test_a_lower_capacity_caps_the_level() -> None:
    state = admit_n(None, key(rpm=100), T0)
    assert advance(state.rpm, 10, T0 + 1).level == 10.0


def test_the_record_expires_once_everything_is_full_again() -> None:
    k = key(rpm=60, tpm=60, max_concurrent=3)
    state = admit_n(None, k, T0)
    assert expires_in(state, k, T0) == pytest.approx(LEASE)
    state = settle(state, k, node="a", in_flight=1, tokens=120, now=T0, lease_s=LEASE)  # 60 tokens of debt
    assert expires_in(state, k, T0) == pytest.approx(120.0)
    assert expires_in(KeyState(), k, T0) == 0.0


def test_a_key_without_limits_is_not_limited() -> None:
    assert not limited(key())
    assert limited(key(max_concurrent=1)) and limited(key(tpm=1)) and limited(key(rpm=1))


def test_the_record_round_trips_as_json() -> None:
    state = admit_n(None, key(rpm=5, tpm=100, max_concurrent=2), T0)
    assert msgspec.json.decode(msgspec.json.encode(state), type=KeyState) == state


@given(
    st.lists(st.tuples(st.floats(0, 30), st.sampled_from("ab"), st.integers(0, 500)), max_size=60),
    st.integers(1, 20),
)
def test_rpm_never_admits_more_than_its_capacity_plus_refill(steps: list[tuple[float, str, int]], rpm: int) -> None:
    k = key(rpm=rpm, tpm=1000)
    state: KeyState | None = None
    now = T0
    admitted = 0
    for gap, node, tokens in steps:
        now += gap
        verdict = admit(state, k, node=node, in_flight=0, tokens=tokens, now=now, lease_s=LEASE)
        if isinstance(verdict, KeyState):
            state = verdict
            admitted += 1
            assert verdict.tpm is not None and verdict.tpm.level <= 1000
        else:
            assert verdict.retry_after_s >= 1
    assert admitted <= rpm + (now - T0) * rpm / 60 + 1e-6


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.floats(0, 2)), max_size=80), st.integers(1, 5))
def test_doors_sharing_one_record_never_hold_more_than_max_concurrent(
    steps: list[tuple[str, bool, float]], limit: int
) -> None:
    k = key(max_concurrent=limit)
    state: KeyState | None = None
    held = {"a": 0, "b": 0, "c": 0}
    now = T0
    for door, admitting, gap in steps:
        now += gap
        if admitting:
            verdict = admit(state, k, node=door, in_flight=held[door], tokens=0, now=now, lease_s=LEASE)
            if isinstance(verdict, KeyState):
                state = verdict
                held[door] += 1
        elif held[door]:
            held[door] -= 1
            state = settle(state, k, node=door, in_flight=held[door], tokens=0, now=now, lease_s=LEASE)
        # every door renews its lease in time (a live front door's flusher)
        for other, n in held.items():
            if n:
                state = settle(state, k, node=other, in_flight=n, tokens=0, now=now, lease_s=LEASE)
        assert sum(held.values()) <= limit
        assert state is None or sum(lease.n for lease in state.doors.values()) == sum(held.values())
