"""Health by inference (runner core): probes only when due and idle, consecutive failures make a crash, and the
crash says why (completions, not /health) and whether it was out of memory."""

from __future__ import annotations

import signal

from actors.runner.health import InferenceHealth, out_of_memory
from actors.runner.instance_lifecycle import (
    DeadlinePassed,
    Exited,
    Healthy,
    Lifecycle,
    ReportCrashed,
    SetDeadline,
    Signal,
    Spawned,
    Start,
    Timings,
    Unresponsive,
    Verified,
)
from runtime.restart import RestartPolicy


def test_a_probe_is_due_only_after_a_quiet_interval_and_never_while_busy() -> None:
    health = InferenceHealth(probe_interval_s=30.0, failures=3)
    health.started(0.0)
    assert not health.should_probe(10.0, busy=False)
    assert not health.should_probe(40.0, busy=True)  # it would queue behind the running generation
    assert health.should_probe(40.0, busy=False)
    assert not health.should_probe(41.0, busy=False)  # one probe per interval
    health.success(50.0)  # a real completion counts as much as a probe
    assert not health.should_probe(75.0, busy=False) and health.should_probe(81.0, busy=False)


def test_consecutive_failures_make_a_crash_and_one_success_clears_them() -> None:
    health = InferenceHealth(failures=3)
    health.started(0.0)
    assert not health.failure(1.0, "HTTP 500") and not health.failure(2.0, "HTTP 500")
    health.success(3.0)
    assert not health.failure(4.0, "x") and not health.failure(5.0, "x")
    assert health.failure(6.0, "no answer within 30s") and health.last_failure == "no answer within 30s"


def test_an_out_of_memory_death_is_told_apart() -> None:
    assert out_of_memory(1, "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 1e12")
    assert out_of_memory(-signal.SIGKILL, "")  # the kernel's OOM killer
    assert out_of_memory(134, "CUDA error: out of memory")
    assert not out_of_memory(1, "error: unknown argument --foo")
    assert not out_of_memory(0, "")


def _ready_machine() -> Lifecycle:
    machine = Lifecycle(
        Timings(stop_grace_s=5, kill_grace_s=2), RestartPolicy(max_restarts=3, window_s=100, backoff_initial_s=1)
    )
    machine.handle(Start(), 0)
    machine.handle(Spawned(1, pid=7), 0)
    machine.handle(Healthy(1), 0)
    machine.handle(Verified(1), 0)
    assert machine.state == "ready"
    return machine


def test_completions_failing_while_health_answers_are_a_crash_that_says_so() -> None:
    machine = _ready_machine()
    detail = "3 completions failed in a row: POST /completion: no answer within 30s"
    hung = machine.handle(Unresponsive(1, detail, by_inference=True), 1)
    assert hung == [Signal("SIGTERM"), SetDeadline(Timings().hung_grace_s)]  # SIGKILL soon: its task loop hangs
    crashed = machine.handle(Exited(1, -15), 2)[0]
    assert crashed == ReportCrashed(-15, 1, f"completions failed while /health answered: {detail}", killed=False)
    assert machine.state == "restarting"


def test_a_server_the_runner_had_to_sigkill_is_not_called_out_of_memory() -> None:
    machine = _ready_machine()
    machine.handle(Unresponsive(1, "3 completions failed in a row: no answer", by_inference=True), 1)
    assert machine.handle(DeadlinePassed(), 6) == [Signal("SIGKILL"), SetDeadline(2)]  # SIGTERM did not end it
    crashed = machine.handle(Exited(1, -signal.SIGKILL), 7)[0]
    assert isinstance(crashed, ReportCrashed) and crashed.killed
    assert not out_of_memory(crashed.exit_code, "", killed_by_runner=crashed.killed)
    # a SIGKILL nobody in the runner sent (the kernel's OOM killer) still is
    other = _ready_machine()
    unexpected = other.handle(Exited(1, -signal.SIGKILL), 3)[0]
    assert isinstance(unexpected, ReportCrashed) and not unexpected.killed
    assert out_of_memory(unexpected.exit_code, "", killed_by_runner=unexpected.killed)
    # the log's allocation failure says so whoever killed it
    assert out_of_memory(-signal.SIGKILL, "llama_init: failed to allocate compute buffers", killed_by_runner=True)
