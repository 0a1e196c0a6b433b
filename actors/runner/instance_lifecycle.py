"""The lifecycle of one llama-server instance: a state machine fed events, returning actions (runner core).

Rules this module keeps:

* Everything that decides what happens to an instance lives here; the shell (`actors/runner/actor.py`)
  only performs the actions and reports what it observed. This module does no I/O, keeps no clock (the
  caller passes `now` for the restart policy) and never sleeps: it asks for a deadline (`SetDeadline`) and
  is told when it has passed (`DeadlinePassed`). There is at most one deadline at a time.
* Each server process is a *generation*. Events about a process (`Spawned`, `Healthy`, `Verified`,
  `Exited`) carry its generation; one about an earlier generation is stale and ignored.
* The transitions are the table `_TRANSITIONS` at the end. An event that has no entry for the current
  phase changes nothing and returns no action (a late health answer, a second stop request).
* The desired state is "running exactly as stamped". A process that dies, or does not become healthy or
  verified within its deadline, is a crash: the restart policy (capped exponential backoff, at most N
  crashes in a window) restarts it or gives up (`failed`). A running server whose reported settings differ
  from the stamp is stopped and ends `rejected`; that is never retried, since a restart would run the same
  wrong settings. Stopping is SIGTERM, then SIGKILL when the stop deadline passes.
* Events are reported when they are true: `stopped`, `drift_rejected`, `crashed` and `failed` once the
  process has exited, so whoever credits the memory back can rely on the server being gone. A process that
  SIGKILL did not reap within its grace is `stuck` (`ReportStuck`): it may still hold its memory, so nothing
  final is reported; SIGKILL is sent again every `kill_retry_s` until it exits, and only then does the
  instance end as it was going to.

Theory of operation: the shell feeds `Start()`; the machine answers `Spawn(1)`; the shell starts the
process and feeds `Spawned` (or `SpawnFailed`); the machine asks for a readiness deadline; the shell polls
`/health` and feeds `Healthy`; the machine asks for `Verify`; the shell compares `/props`, `/slots` and the
log with the stamp and feeds `Verified(drift)`; the machine reports ready, or stops the server. While ready,
the shell keeps checking `/health` and feeds `Unresponsive` after repeated failures: a hung server is a crash.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from messages.runner import FieldDrift, InstanceState
from runtime.restart import GiveUp, RestartPolicy

__all__ = [
    "Action",
    "DeadlinePassed",
    "Event",
    "Exited",
    "Finish",
    "Healthy",
    "Lifecycle",
    "MemberLost",
    "Phase",
    "ReportCrashed",
    "ReportDrift",
    "ReportFailed",
    "ReportReady",
    "ReportRestarted",
    "ReportStarting",
    "ReportStopped",
    "ReportStuck",
    "SetDeadline",
    "Signal",
    "Spawn",
    "SpawnFailed",
    "Spawned",
    "Start",
    "StopRequested",
    "Timings",
    "Unresponsive",
    "Verified",
    "Verify",
    "exit_reason",
]


class Phase(enum.Enum):
    NEW = "new"
    SPAWNING = "spawning"  # Spawn asked; waiting for the shell to say it started (or could not)
    LOADING = "loading"  # the process runs; waiting for /health
    VERIFYING = "verifying"  # healthy; waiting for the comparison with the stamp
    READY = "ready"
    BACKOFF = "backoff"  # crashed; waiting to restart
    TERMINATING = "terminating"  # signalled; waiting for the process to exit
    STUCK = "stuck"  # SIGKILL did not reap it in time: it may hold its memory; killed again until it exits
    STOPPED = "stopped"
    FAILED = "failed"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Timings:
    ready_timeout_s: float = 600.0  # spawn to /health 200 (a large model loads for minutes)
    verify_timeout_s: float = 30.0  # /health 200 to a verdict on /props, /slots and the log
    stop_grace_s: float = 10.0  # SIGTERM to SIGKILL
    # SIGTERM to SIGKILL for a server that stopped answering: its task loop, which acts on SIGTERM, is what hangs,
    # so waiting the whole grace would only delay the restart (a wedged server in the e2e test never exits on it)
    hung_grace_s: float = 2.0
    kill_grace_s: float = 5.0  # SIGKILL to reporting the process stuck
    kill_retry_s: float = 5.0  # while stuck, SIGKILL is sent again this often (until the process exits)
    liveness_interval_s: float = 10.0  # a ready server's /health is checked this often
    liveness_failures: int = 3  # consecutive failed checks that make a ready server a crash


# --- events (inputs) -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class Spawned:
    generation: int
    pid: int


@dataclass(frozen=True)
class SpawnFailed:
    generation: int
    error: str


@dataclass(frozen=True)
class Healthy:
    generation: int


@dataclass(frozen=True)
class Unresponsive:
    """A ready server failed its liveness check `Timings.liveness_failures` times in a row (it hangs), or its
    completions failed that often in a row while `/health` answered (`by_inference`)."""

    generation: int
    detail: str
    by_inference: bool = False


@dataclass(frozen=True)
class MemberLost:
    """A split's member stopped serving its part while the server was loaded (its RPC connection ended): the
    server has lost devices that hold its layers, so it is a crash naming the member."""

    generation: int
    member: str
    detail: str


@dataclass(frozen=True)
class Verified:
    """The verdict on a healthy server: `drift` (empty when it runs as stamped), or `error` when the
    comparison itself failed (e.g. `/props` did not answer)."""

    generation: int
    drift: tuple[FieldDrift, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class Exited:
    generation: int
    code: int | None


@dataclass(frozen=True)
class StopRequested:
    reason: str


@dataclass(frozen=True)
class DeadlinePassed:
    pass


Event = (
    Start
    | Spawned
    | SpawnFailed
    | Healthy
    | Verified
    | Unresponsive
    | MemberLost
    | Exited
    | StopRequested
    | DeadlinePassed
)

# --- actions (outputs) -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    generation: int


@dataclass(frozen=True)
class Verify:
    generation: int


@dataclass(frozen=True)
class Signal:
    signal: Literal["SIGTERM", "SIGKILL"]


@dataclass(frozen=True)
class SetDeadline:
    """Feed `DeadlinePassed` after `seconds` unless another event comes first; None clears the deadline."""

    seconds: float | None


@dataclass(frozen=True)
class ReportStarting:
    generation: int


@dataclass(frozen=True)
class ReportRestarted:
    attempt: int


@dataclass(frozen=True)
class ReportReady:
    generation: int


@dataclass(frozen=True)
class ReportDrift:
    drift: tuple[FieldDrift, ...]


@dataclass(frozen=True)
class ReportCrashed:
    exit_code: int | None
    restart_in_s: float | None  # None: not restarted
    reason: str
    killed: bool = False  # the machine itself sent SIGKILL (a stop that SIGTERM did not end): not the kernel's
    member: str | None = None  # a split's member whose loss caused the crash


@dataclass(frozen=True)
class ReportStopped:
    reason: str


@dataclass(frozen=True)
class ReportFailed:
    reason: str


@dataclass(frozen=True)
class ReportStuck:
    """The process did not exit after SIGKILL: its memory may still be held. Not final."""

    pid: int | None
    reason: str


@dataclass(frozen=True)
class Finish:
    """The instance reached a final phase; the shell ends its driver."""


Action = (
    Spawn
    | Verify
    | Signal
    | SetDeadline
    | ReportStarting
    | ReportRestarted
    | ReportReady
    | ReportDrift
    | ReportCrashed
    | ReportStopped
    | ReportFailed
    | ReportStuck
    | Finish
)

_After = Literal["stop", "reject", "crash"]
_FINAL = frozenset({Phase.STOPPED, Phase.FAILED, Phase.REJECTED})
_PUBLIC: dict[Phase, InstanceState] = {
    Phase.NEW: "starting",
    Phase.SPAWNING: "starting",
    Phase.LOADING: "starting",
    Phase.VERIFYING: "starting",
    Phase.READY: "ready",
    Phase.BACKOFF: "restarting",
    Phase.TERMINATING: "stopping",
    Phase.STUCK: "stuck",
    Phase.STOPPED: "stopped",
    Phase.FAILED: "failed",
    Phase.REJECTED: "rejected",
}


class Lifecycle:
    """One instance's state machine. `handle(event, now)` returns the actions to perform, in order."""

    def __init__(self, timings: Timings, policy: RestartPolicy) -> None:
        self.timings = timings
        self.phase = Phase.NEW
        self.generation = 0
        self.restarts = 0
        self.pid: int | None = None
        self.reason = ""  # why the instance is terminating, or how it ended
        self.stuck = ""  # while stuck: why (the process did not exit after SIGKILL)
        self._policy = policy
        self._after: _After = "stop"
        self._exit_code: int | None = None
        self._killed = False
        self._pending_stop: str | None = None
        self._drift: tuple[FieldDrift, ...] = ()
        self._member: str | None = None  # the member whose loss made this generation crash

    @property
    def state(self) -> InstanceState:
        """The public state (`InstanceStatus.state`)."""
        if self.generation > 1 and self.phase in (Phase.SPAWNING, Phase.LOADING, Phase.VERIFYING):
            return "restarting"
        return _PUBLIC[self.phase]

    @property
    def done(self) -> bool:
        return self.phase in _FINAL

    @property
    def message(self) -> str:
        """What a person reads in the instance's record."""
        return self.stuck if self.phase is Phase.STUCK else self.reason

    def handle(self, event: Event, now: float) -> list[Action]:
        generation = getattr(event, "generation", None)
        if generation is not None and generation != self.generation:
            return []  # about an earlier process
        transition = _TRANSITIONS.get((self.phase, type(event)))
        if transition is None:
            return []
        return transition(self, event, now)

    def abandon(self, reason: str, *, failed: bool = False) -> None:
        """The shell ended the instance outside the machine, after it confirmed the server reaped: the
        runner is stopping (stopped), or the driver itself failed (`failed`). The only way to a final
        phase that bypasses the table."""
        if not self.done:
            self.phase, self.reason, self.pid = (Phase.FAILED if failed else Phase.STOPPED), reason, None

    # --- transitions ---------------------------------------------------------------------------------

    def _spawn(self, event: Event, now: float) -> list[Action]:
        self.generation += 1
        self.phase = Phase.SPAWNING
        self.pid = None
        self._member = None
        return [SetDeadline(None), Spawn(self.generation)]

    def _spawned(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, Spawned)
        self.pid = event.pid
        self.phase = Phase.LOADING
        actions: list[Action] = [ReportStarting(self.generation)]
        if self.generation > 1:
            actions.append(ReportRestarted(self.generation))
        if self._pending_stop is not None:
            return [*actions, *self._terminate("stop", self._pending_stop)]
        return [*actions, SetDeadline(self.timings.ready_timeout_s)]

    def _spawn_failed(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, SpawnFailed)
        if self._pending_stop is not None:
            return self._finish(Phase.STOPPED, self._pending_stop, [ReportStopped(self._pending_stop)])
        return self._crashed(None, f"could not start llama-server: {event.error}", now)

    def _stop_while_spawning(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, StopRequested)
        self._pending_stop = event.reason
        return []

    def _healthy(self, event: Event, now: float) -> list[Action]:
        self.phase = Phase.VERIFYING
        return [SetDeadline(self.timings.verify_timeout_s), Verify(self.generation)]

    def _verified(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, Verified)
        if event.error is not None:
            return self._terminate("crash", f"could not verify the server: {event.error}")
        if event.drift:
            self._drift = event.drift
            fields = ", ".join(d.field for d in event.drift)
            return self._terminate("reject", f"settings drift after start: {fields}")
        self.phase, self.reason = Phase.READY, ""
        return [SetDeadline(None), ReportReady(self.generation)]

    def _not_ready(self, event: Event, now: float) -> list[Action]:
        if self.phase is Phase.LOADING:
            why = f"not healthy within {self.timings.ready_timeout_s:g}s"
        else:
            why = f"not verified within {self.timings.verify_timeout_s:g}s"
        return self._terminate("crash", why)

    def _unresponsive(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, Unresponsive)
        grace = self.timings.hung_grace_s
        if event.by_inference:
            return self._terminate("crash", f"completions failed while /health answered: {event.detail}", grace)
        return self._terminate("crash", f"stopped answering /health: {event.detail}", grace)

    def _member_lost(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, MemberLost)
        self._member = event.member
        return self._terminate("crash", f"split member {event.member} is gone: {event.detail}")

    def _exited(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, Exited)
        self.pid = None
        return self._crashed(event.code, exit_reason(event.code), now)

    def _stop(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, StopRequested)
        return self._terminate("stop", event.reason)

    def _stop_in_backoff(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, StopRequested)
        return self._finish(Phase.STOPPED, event.reason, [ReportStopped(event.reason)])

    def _stop_while_terminating(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, StopRequested)
        if self._after == "crash":  # it was going to be restarted; now it stays stopped
            self._after, self.reason = "stop", event.reason
        return []

    def _gone(self, event: Event, now: float) -> list[Action]:
        assert isinstance(event, Exited)
        self.pid, self.stuck = None, ""
        if self._after == "stop":
            return self._finish(Phase.STOPPED, self.reason, [ReportStopped(self.reason)])
        if self._after == "reject":
            return self._finish(Phase.REJECTED, self.reason, [ReportDrift(self._drift)])
        return self._crashed(event.code, self.reason, now, killed=self._killed)

    def _stop_deadline(self, event: Event, now: float) -> list[Action]:
        if not self._killed:
            self._killed = True
            return [Signal("SIGKILL"), SetDeadline(self.timings.kill_grace_s)]
        # Not reaped: it may still hold its memory, so it is not reported gone. Keep killing it.
        self.phase = Phase.STUCK
        self.stuck = (
            f"llama-server (pid {self.pid}) did not exit within {self.timings.kill_grace_s:g}s of SIGKILL; "
            f"SIGKILL again every {self.timings.kill_retry_s:g}s, its memory stays held"
        )
        return [ReportStuck(self.pid, self.stuck), Signal("SIGKILL"), SetDeadline(self.timings.kill_retry_s)]

    def _kill_again(self, event: Event, now: float) -> list[Action]:
        return [Signal("SIGKILL"), SetDeadline(self.timings.kill_retry_s)]

    # --- helpers ---------------------------------------------------------------------------------------

    def _terminate(self, after: _After, reason: str, grace_s: float | None = None) -> list[Action]:
        """SIGTERM, then SIGKILL after `grace_s` (default: the stop grace)."""
        self.phase = Phase.TERMINATING
        self._after, self.reason, self._killed = after, reason, False
        return [Signal("SIGTERM"), SetDeadline(self.timings.stop_grace_s if grace_s is None else grace_s)]

    def _crashed(self, code: int | None, reason: str, now: float, *, killed: bool = False) -> list[Action]:
        self._exit_code = code
        decision = self._policy.on_crash(now)
        if isinstance(decision, GiveUp):
            window = f"{self._policy.window_s:g}s"
            why = f"gave up after {decision.crashes_in_window} crashes within {window} (last: {reason})"
            crashed = ReportCrashed(code, None, reason, killed, self._member)
            return self._finish(Phase.FAILED, why, [crashed, ReportFailed(why)])
        self.phase = Phase.BACKOFF
        self.reason = reason
        self.restarts += 1
        return [ReportCrashed(code, decision.delay_s, reason, killed, self._member), SetDeadline(decision.delay_s)]

    def _finish(self, phase: Phase, reason: str, reports: list[Action]) -> list[Action]:
        self.phase, self.reason, self.stuck = phase, reason, ""
        return [SetDeadline(None), *reports, Finish()]


_Transition = Callable[[Lifecycle, Event, float], list[Action]]
_RUNNING = (Phase.LOADING, Phase.VERIFYING, Phase.READY)

_TRANSITIONS: dict[tuple[Phase, type], _Transition] = {
    (Phase.NEW, Start): Lifecycle._spawn,
    (Phase.NEW, StopRequested): Lifecycle._stop_in_backoff,  # nothing runs yet: stopped at once
    (Phase.SPAWNING, Spawned): Lifecycle._spawned,
    (Phase.SPAWNING, SpawnFailed): Lifecycle._spawn_failed,
    (Phase.SPAWNING, StopRequested): Lifecycle._stop_while_spawning,
    (Phase.LOADING, Healthy): Lifecycle._healthy,
    (Phase.LOADING, DeadlinePassed): Lifecycle._not_ready,
    (Phase.VERIFYING, Verified): Lifecycle._verified,
    (Phase.VERIFYING, DeadlinePassed): Lifecycle._not_ready,
    (Phase.READY, Unresponsive): Lifecycle._unresponsive,
    # while loading, llama-server's RPC client may open and close connections of its own; once loaded, its
    # buffers hold one connection per member for the server's life
    (Phase.VERIFYING, MemberLost): Lifecycle._member_lost,
    (Phase.READY, MemberLost): Lifecycle._member_lost,
    **{(phase, Exited): Lifecycle._exited for phase in _RUNNING},
    **{(phase, StopRequested): Lifecycle._stop for phase in _RUNNING},
    (Phase.BACKOFF, DeadlinePassed): Lifecycle._spawn,
    (Phase.BACKOFF, StopRequested): Lifecycle._stop_in_backoff,
    (Phase.TERMINATING, Exited): Lifecycle._gone,
    (Phase.TERMINATING, DeadlinePassed): Lifecycle._stop_deadline,
    (Phase.TERMINATING, StopRequested): Lifecycle._stop_while_terminating,
    (Phase.STUCK, Exited): Lifecycle._gone,
    (Phase.STUCK, DeadlinePassed): Lifecycle._kill_again,
    (Phase.STUCK, StopRequested): Lifecycle._stop_while_terminating,
}


#: The usual causes of the signals that end llama-server, for the operator reading the crash.
_SIGNAL_CAUSES = {
    signal.SIGKILL: "the kernel's out-of-memory killer, or an operator",
    signal.SIGILL: "an instruction this CPU refused: a build for another CPU, or a VM that advertises a feature "
    "(such as AMX) it does not run",
    signal.SIGSEGV: "a memory fault in the engine",
    signal.SIGABRT: "the engine aborted; its log says why",
}


def exit_reason(code: int | None) -> str:
    """Why llama-server ended, from its exit status (negative: the signal that killed it, named with its usual
    cause)."""
    if code is None or code >= 0:
        return f"llama-server exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"llama-server was killed by signal {-code}"
    cause = _SIGNAL_CAUSES.get(sig)
    return f"llama-server was killed by {sig.name}" + (f" ({cause})" if cause else "")
