"""The instance lifecycle state machine: fed events, it returns the actions; no process, no clock."""

from __future__ import annotations

import copy
import signal

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.runner.instance_lifecycle import (
    Action,
    DeadlinePassed,
    Event,
    Exited,
    Finish,
    Healthy,
    Lifecycle,
    MemberLost,
    Phase,
    ReportCrashed,
    ReportDrift,
    ReportFailed,
    ReportReady,
    ReportRestarted,
    ReportStarting,
    ReportStopped,
    ReportStuck,
    SetDeadline,
    Signal,
    Spawn,
    Spawned,
    SpawnFailed,
    Start,
    StopRequested,
    Timings,
    Unresponsive,
    Verified,
    Verify,
    exit_reason,
)
from messages.runner import FieldDrift, InstanceState
from runtime.restart import RestartPolicy

TIMINGS = Timings(ready_timeout_s=60, verify_timeout_s=10, stop_grace_s=5, kill_grace_s=2)
DRIFT = (FieldDrift(field="props.total_slots", stamped="2", current="1"),)


def machine(max_restarts: int = 2) -> Lifecycle:
    return Lifecycle(TIMINGS, RestartPolicy(max_restarts=max_restarts, window_s=100, backoff_initial_s=1))


def state(m: Lifecycle) -> InstanceState:
    """`m.state`, read through a call: mypy keeps a narrowed `m.state` across `m.handle()`, which changes it."""
    return m.state


def ready(m: Lifecycle, generation: int = 1, now: float = 0.0) -> None:
    if generation == 1:
        assert m.handle(Start(), now) == [SetDeadline(None), Spawn(1)]
    m.handle(Spawned(generation, pid=100 + generation), now)
    m.handle(Healthy(generation), now)
    m.handle(Verified(generation), now)
    assert m.phase is Phase.READY


def test_start_spawns_waits_for_health_verifies_and_reports_ready() -> None:
    m = machine()
    assert m.handle(Start(), 0) == [SetDeadline(None), Spawn(1)]
    assert m.state == "starting"
    assert m.handle(Spawned(1, pid=42), 0) == [ReportStarting(1), SetDeadline(60)]
    assert m.pid == 42
    assert m.handle(Healthy(1), 0) == [SetDeadline(10), Verify(1)]
    assert m.state == "starting"
    assert m.handle(Verified(1), 0) == [SetDeadline(None), ReportReady(1)]
    assert (m.state, m.restarts) == ("ready", 0)


def test_a_crash_restarts_after_backoff_and_the_restart_is_reported() -> None:
    m = machine()
    ready(m)
    assert m.handle(Exited(1, code=-9), 5) == [
        ReportCrashed(-9, 1, "llama-server was killed by SIGKILL (the kernel's out-of-memory killer, or an operator)"),
        SetDeadline(1),
    ]
    assert (m.state, m.restarts, m.pid) == ("restarting", 1, None)
    assert m.handle(DeadlinePassed(), 6) == [SetDeadline(None), Spawn(2)]
    assert m.state == "restarting"
    assert m.handle(Spawned(2, pid=7), 6) == [ReportStarting(2), ReportRestarted(2), SetDeadline(60)]
    m.handle(Healthy(2), 6)
    assert m.handle(Verified(2), 6) == [SetDeadline(None), ReportReady(2)]
    assert state(m) == "ready"


def test_a_hung_ready_server_is_stopped_and_restarted_as_a_crash() -> None:
    m = machine()
    ready(m)
    assert m.handle(Unresponsive(1, "3 checks in a row: timed out"), 5) == [
        Signal("SIGTERM"),
        SetDeadline(TIMINGS.hung_grace_s),  # shorter than a stop's: its hung loop would not act on SIGTERM
    ]
    assert TIMINGS.hung_grace_s < TIMINGS.stop_grace_s
    assert m.handle(Unresponsive(1, "again"), 5) == []  # already being stopped
    assert m.handle(Exited(1, code=-15), 6) == [
        ReportCrashed(-15, 1, "stopped answering /health: 3 checks in a row: timed out"),
        SetDeadline(1),
    ]
    assert m.handle(Unresponsive(1, "late"), 6) == []  # about the old process
    assert m.handle(DeadlinePassed(), 7) == [SetDeadline(None), Spawn(2)]


def test_backoff_doubles_and_too_many_crashes_give_up_as_failed() -> None:
    m = machine(max_restarts=2)
    ready(m)
    assert m.handle(Exited(1, code=1), 0)[0] == ReportCrashed(1, 1, "llama-server exited with code 1")
    m.handle(DeadlinePassed(), 1)
    ready(m, generation=2, now=1)
    assert m.handle(Exited(2, code=1), 2)[0] == ReportCrashed(1, 2, "llama-server exited with code 1")
    m.handle(DeadlinePassed(), 4)
    ready(m, generation=3, now=4)
    actions = m.handle(Exited(3, code=139), 5)
    assert actions[0] == SetDeadline(None)
    assert actions[1] == ReportCrashed(139, None, "llama-server exited with code 139")
    assert isinstance(actions[2], ReportFailed) and "gave up after 3 crashes" in actions[2].reason
    assert actions[3] == Finish()
    assert (m.state, m.done) == ("failed", True)


def test_drift_after_start_stops_the_server_reports_once_it_is_gone_and_is_never_retried() -> None:
    m = machine()
    m.handle(Start(), 0)
    m.handle(Spawned(1, pid=1), 0)
    m.handle(Healthy(1), 0)
    assert m.handle(Verified(1, drift=DRIFT), 0) == [Signal("SIGTERM"), SetDeadline(5)]
    assert m.state == "stopping"
    assert m.handle(Exited(1, code=0), 1) == [SetDeadline(None), ReportDrift(DRIFT), Finish()]
    assert (m.state, m.restarts) == ("rejected", 0)
    assert "props.total_slots" in m.reason


def test_stop_is_sigterm_then_sigkill_after_the_grace_period() -> None:
    m = machine()
    ready(m)
    assert m.handle(StopRequested("asked"), 0) == [Signal("SIGTERM"), SetDeadline(5)]
    assert m.handle(DeadlinePassed(), 5) == [Signal("SIGKILL"), SetDeadline(2)]
    assert m.handle(Exited(1, code=-9), 6) == [SetDeadline(None), ReportStopped("asked"), Finish()]
    assert m.state == "stopped"


def test_a_server_that_survives_sigkill_is_stuck_and_killed_again_until_it_exits_then_stopped() -> None:
    """Its memory may still be held: nothing final is reported (placement would release the memory)."""
    m = machine()
    ready(m)
    m.handle(StopRequested("asked"), 0)
    m.handle(DeadlinePassed(), 5)
    actions = m.handle(DeadlinePassed(), 7)
    assert actions[0] == ReportStuck(101, m.stuck) and "did not exit within 2s of SIGKILL" in m.stuck
    assert actions[1:] == [Signal("SIGKILL"), SetDeadline(5)]
    assert (m.state, m.done, m.pid, m.message) == ("stuck", False, 101, m.stuck)
    for t in (12, 17):  # kept killing, never reported gone
        assert m.handle(DeadlinePassed(), t) == [Signal("SIGKILL"), SetDeadline(5)]
    assert m.handle(StopRequested("again"), 18) == []
    assert m.handle(Exited(1, code=-9), 19) == [SetDeadline(None), ReportStopped("asked"), Finish()]
    assert (m.state, m.message, m.pid) == ("stopped", "asked", None)


def test_a_drifting_server_that_is_stuck_is_rejected_only_once_it_exits() -> None:
    m = machine()
    m.handle(Start(), 0)
    m.handle(Spawned(1, pid=7), 0)
    m.handle(Healthy(1), 0)
    m.handle(Verified(1, DRIFT), 0)
    m.handle(DeadlinePassed(), 5)
    assert isinstance(m.handle(DeadlinePassed(), 7)[0], ReportStuck)
    assert m.handle(Exited(1, code=-9), 8) == [SetDeadline(None), ReportDrift(DRIFT), Finish()]
    assert m.state == "rejected"


def test_abandon_as_failed_records_a_driver_failure() -> None:
    m = machine()
    ready(m)
    m.abandon("the runner's driver failed: RuntimeError: boom", failed=True)
    assert (m.state, m.done, m.pid) == ("failed", True, None)


def test_not_healthy_in_time_is_a_crash_once_the_server_is_stopped() -> None:
    m = machine()
    m.handle(Start(), 0)
    m.handle(Spawned(1, pid=1), 0)
    assert m.handle(DeadlinePassed(), 60) == [Signal("SIGTERM"), SetDeadline(5)]
    assert m.handle(Exited(1, code=-15), 61) == [ReportCrashed(-15, 1, "not healthy within 60s"), SetDeadline(1)]
    assert m.state == "restarting"


def test_a_failed_verification_is_a_crash_and_a_late_one_too() -> None:
    m = machine()
    m.handle(Start(), 0)
    m.handle(Spawned(1, pid=1), 0)
    m.handle(Healthy(1), 0)
    assert m.handle(Verified(1, error="GET /props: HTTP 500"), 0) == [Signal("SIGTERM"), SetDeadline(5)]
    crashed = m.handle(Exited(1, code=0), 1)[0]
    assert isinstance(crashed, ReportCrashed) and "HTTP 500" in crashed.reason

    late = machine()
    late.handle(Start(), 0)
    late.handle(Spawned(1, pid=1), 0)
    late.handle(Healthy(1), 0)
    assert late.handle(DeadlinePassed(), 10) == [Signal("SIGTERM"), SetDeadline(5)]
    assert late.reason == "not verified within 10s"


def test_a_process_that_cannot_be_spawned_counts_as_a_crash() -> None:
    m = machine()
    m.handle(Start(), 0)
    actions = m.handle(SpawnFailed(1, "No such file"), 0)
    assert actions == [ReportCrashed(None, 1, "could not start llama-server: No such file"), SetDeadline(1)]


def test_stop_during_backoff_ends_at_once_without_another_spawn() -> None:
    m = machine()
    ready(m)
    m.handle(Exited(1, code=1), 0)
    assert m.handle(StopRequested("asked"), 0) == [SetDeadline(None), ReportStopped("asked"), Finish()]
    assert m.handle(DeadlinePassed(), 1) == []
    assert m.state == "stopped"


def test_stop_while_spawning_stops_the_process_as_soon_as_it_exists() -> None:
    m = machine()
    m.handle(Start(), 0)
    assert m.handle(StopRequested("asked"), 0) == []
    assert m.handle(Spawned(1, pid=3), 0) == [ReportStarting(1), Signal("SIGTERM"), SetDeadline(5)]
    assert m.handle(Exited(1, code=0), 0)[1] == ReportStopped("asked")


def test_stop_while_terminating_for_a_restart_turns_it_into_a_stop() -> None:
    m = machine()
    m.handle(Start(), 0)
    m.handle(Spawned(1, pid=1), 0)
    m.handle(DeadlinePassed(), 60)  # not healthy: terminating, then a restart was planned
    assert m.handle(StopRequested("asked"), 61) == []
    assert m.handle(Exited(1, code=0), 62) == [SetDeadline(None), ReportStopped("asked"), Finish()]


def test_events_about_an_earlier_process_are_ignored() -> None:
    m = machine()
    ready(m)
    m.handle(Exited(1, code=1), 0)
    m.handle(DeadlinePassed(), 1)
    m.handle(Spawned(2, pid=5), 1)
    assert m.handle(Exited(1, code=1), 1) == []
    assert m.handle(Healthy(1), 1) == []
    assert m.phase is Phase.LOADING


def test_events_without_a_transition_change_nothing() -> None:
    m = machine()
    ready(m)
    assert m.handle(Healthy(1), 0) == []
    assert m.handle(Start(), 0) == []
    assert m.state == "ready"


def test_a_final_machine_accepts_nothing_and_abandon_does_not_revive_it() -> None:
    m = machine()
    ready(m)
    m.handle(StopRequested("asked"), 0)
    m.handle(Exited(1, code=0), 0)
    for event in (Start(), Exited(1, 0), StopRequested("x"), DeadlinePassed(), Healthy(1)):
        assert m.handle(event, 0) == []
    m.abandon("runner stopped")
    assert (m.state, m.reason) == ("stopped", "asked")


def test_abandon_records_a_running_instance_as_stopped() -> None:
    m = machine()
    ready(m)
    m.abandon("runner stopped")
    assert (m.state, m.reason, m.pid, m.done) == ("stopped", "runner stopped", None, True)


# --- a split's member lost -----------------------------------------------------------------------------------


def test_a_member_lost_while_ready_stops_the_server_and_reports_a_crash_naming_the_member() -> None:
    m = machine()
    ready(m)
    assert m.handle(MemberLost(1, "m2", "its RPC connection was closed by the far end"), 5) == [
        Signal("SIGTERM"),
        SetDeadline(TIMINGS.stop_grace_s),
    ]
    assert m.state == "stopping"
    assert m.handle(MemberLost(1, "m3", "also gone"), 5) == []  # already being stopped: the first one is named
    reason = "split member m2 is gone: its RPC connection was closed by the far end"
    assert m.handle(Exited(1, code=-15), 6) == [ReportCrashed(-15, 1, reason, member="m2"), SetDeadline(1)]
    assert (m.state, m.restarts, m.reason) == ("restarting", 1, reason)
    assert m.handle(DeadlinePassed(), 7) == [SetDeadline(None), Spawn(2)]


def test_a_member_lost_that_sigterm_does_not_end_is_killed_and_still_names_the_member() -> None:
    m = machine()
    ready(m)
    m.handle(MemberLost(1, "m2", "reset"), 0)
    assert m.handle(DeadlinePassed(), 5) == [Signal("SIGKILL"), SetDeadline(TIMINGS.kill_grace_s)]
    crashed = m.handle(Exited(1, code=-9), 6)[0]
    assert crashed == ReportCrashed(-9, 1, "split member m2 is gone: reset", killed=True, member="m2")


def test_a_member_lost_while_verifying_is_a_crash_too() -> None:
    m = machine()
    m.handle(Start(), 0)
    m.handle(Spawned(1, pid=1), 0)
    m.handle(Healthy(1), 0)
    assert m.handle(MemberLost(1, "m2", "reset"), 0) == [Signal("SIGTERM"), SetDeadline(5)]
    crashed = m.handle(Exited(1, code=0), 1)[0]
    assert isinstance(crashed, ReportCrashed) and crashed.member == "m2"


def test_a_member_lost_while_loading_is_ignored() -> None:
    """While loading, llama-server's RPC client opens and closes connections of its own."""
    m = machine()
    m.handle(Start(), 0)
    m.handle(Spawned(1, pid=1), 0)
    assert m.handle(MemberLost(1, "m2", "closed by the far end"), 0) == []
    assert (m.phase, m.reason) == (Phase.LOADING, "")
    m.handle(Healthy(1), 0)
    assert m.handle(Verified(1), 0) == [SetDeadline(None), ReportReady(1)]
    assert m.handle(Exited(1, code=1), 1)[0] == ReportCrashed(1, 1, "llama-server exited with code 1")


def test_a_member_lost_of_an_earlier_generation_is_ignored() -> None:
    m = machine()
    ready(m)
    m.handle(Exited(1, code=1), 0)
    m.handle(DeadlinePassed(), 1)
    ready(m, generation=2, now=1)
    assert m.handle(MemberLost(1, "m2", "the old server's link"), 2) == []
    assert m.state == "ready"
    assert m.handle(MemberLost(2, "m2", "reset"), 3) == [Signal("SIGTERM"), SetDeadline(5)]


def test_after_a_member_crash_the_next_generations_plain_crash_names_no_member() -> None:
    m = machine(max_restarts=3)
    ready(m)
    m.handle(MemberLost(1, "m2", "reset"), 0)
    first = m.handle(Exited(1, code=-15), 1)[0]
    assert isinstance(first, ReportCrashed) and first.member == "m2"
    m.handle(DeadlinePassed(), 2)
    ready(m, generation=2, now=2)
    assert m.handle(Exited(2, code=139), 3) == [
        ReportCrashed(139, 2, "llama-server exited with code 139", member=None),
        SetDeadline(2),
    ]


def test_a_member_crash_past_the_restart_limit_fails_naming_the_member() -> None:
    m = machine(max_restarts=0)
    ready(m)
    m.handle(MemberLost(1, "m2", "reset"), 0)
    actions = m.handle(Exited(1, code=-15), 1)
    assert actions[1] == ReportCrashed(-15, None, "split member m2 is gone: reset", member="m2")
    assert isinstance(actions[2], ReportFailed) and "split member m2 is gone" in actions[2].reason
    assert (m.state, m.done) == ("failed", True)


# --- properties over arbitrary event sequences -------------------------------------------------------------


def _events(max_generation: int = 4) -> st.SearchStrategy[Event]:
    gen = st.integers(min_value=1, max_value=max_generation)
    return st.one_of(
        st.just(Start()),
        st.builds(Spawned, gen, st.integers(min_value=1, max_value=99)),
        st.builds(SpawnFailed, gen, st.just("boom")),
        st.builds(Healthy, gen),
        st.builds(Verified, gen, st.sampled_from([(), DRIFT])),
        st.builds(Verified, gen, st.just(()), st.just("no answer")),
        st.builds(Exited, gen, st.sampled_from([0, 1, -9, None])),
        st.builds(Unresponsive, gen, st.just("hung")),
        st.builds(MemberLost, gen, st.sampled_from(["m2", "m3"]), st.just("gone")),
        st.builds(StopRequested, st.just("asked")),
        st.just(DeadlinePassed()),
    )


@settings(max_examples=400)
@given(st.lists(_events(), max_size=40))
def test_any_event_sequence_keeps_the_invariants(events: list[Event]) -> None:
    """Whatever arrives, in whatever order: a Finish exactly when the machine becomes final and nothing
    after it; never a second process while one may be alive; never an ending reported (stopped, failed,
    rejected, crashed: placement credits the memory back) while one may be alive; ready only after a clean
    verification; a crash names a split member exactly when that member's loss is what stopped its process."""
    m = machine(max_restarts=3)
    alive = False  # a process of the current generation exists (spawned and not yet exited)
    verified_clean = False
    lost: str | None = None  # the member whose loss made the machine stop the current process
    for i, event in enumerate(events):
        was_done = m.done
        actions: list[Action] = m.handle(event, float(i))
        if was_done:
            assert actions == []
            continue
        if isinstance(event, Spawned) and event.generation == m.generation and m.pid == event.pid:
            alive = True  # the machine took the process as its own (a stale Spawned is ignored)
        if isinstance(event, Exited) and event.generation == m.generation and m.pid is None:
            alive = False
        for action in actions:
            if isinstance(action, Spawn):
                assert not alive, "spawned while a process may be alive"
                verified_clean, lost = False, None
            if isinstance(event, MemberLost) and action == Signal("SIGTERM"):
                lost = event.member
            if isinstance(action, ReportCrashed):
                assert action.member == lost
            if isinstance(action, ReportReady):
                assert isinstance(event, Verified) and not event.drift and event.error is None
                verified_clean = True
            if isinstance(action, ReportStopped | ReportFailed | ReportDrift | ReportCrashed | Finish):
                assert not alive, f"{action} while the process may be alive"
        assert (Finish() in actions) == m.done
        if m.state == "ready":
            assert verified_clean


@settings(max_examples=200)
@given(st.data())
def test_a_crash_names_a_member_exactly_when_that_members_loss_stopped_the_process(data: st.DataObject) -> None:
    """A walk that mostly takes an event the machine acts on (so it gets past loading, often into a member's
    loss and the restart after it), sometimes one it ignores (a stale generation, a loss while loading) or a
    stop: every crash names the member whose loss made the machine stop that process, and no other crash does."""
    m = machine(max_restarts=5)
    lost: str | None = None
    for i in range(data.draw(st.integers(min_value=10, max_value=60), label="steps")):
        if m.done:
            break
        gen, member = m.generation, data.draw(st.sampled_from(["m2", "m3"]), label="member")
        candidates: list[Event] = [
            Start(),
            Spawned(gen, pid=10 + gen),
            SpawnFailed(gen, "boom"),
            Healthy(gen),
            Verified(gen),
            Exited(gen, code=1),
            Unresponsive(gen, "hung"),
            MemberLost(gen, member, "gone"),
            MemberLost(gen - 1, member, "an earlier process's link"),
            DeadlinePassed(),
        ]
        acted = [e for e in candidates if copy.deepcopy(m).handle(e, float(i))]
        ignored = [e for e in candidates if e not in acted]
        roll = data.draw(st.integers(min_value=0, max_value=19), label="roll")
        if roll == 0 or not acted:
            event = data.draw(st.sampled_from(ignored), label="ignored")
        elif roll == 1:
            event = StopRequested("asked")
        else:
            event = data.draw(st.sampled_from(acted), label="acted")
        for action in m.handle(event, float(i)):
            if isinstance(action, Spawn):
                lost = None
            if isinstance(event, MemberLost) and action == Signal("SIGTERM"):
                lost = event.member
            if isinstance(action, ReportCrashed):
                assert action.member == lost


def test_a_signal_that_ended_the_server_is_named_with_its_usual_cause() -> None:
    assert exit_reason(1) == "llama-server exited with code 1"
    assert exit_reason(139) == "llama-server exited with code 139"  # a shell's 128 + SIGSEGV: a code as it is
    illegal = exit_reason(-int(signal.SIGILL))
    assert illegal.startswith("llama-server was killed by SIGILL (") and "AMX" in illegal
    assert exit_reason(-int(signal.SIGSEGV)) == "llama-server was killed by SIGSEGV (a memory fault in the engine)"
    assert exit_reason(-int(signal.SIGUSR2)) == "llama-server was killed by SIGUSR2"
    assert exit_reason(-200) == "llama-server was killed by signal 200"
