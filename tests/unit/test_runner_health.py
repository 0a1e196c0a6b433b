"""Health by inference (runner core): probes only when due and idle, consecutive failures make a crash."""

from __future__ import annotations

import signal

from actors.runner.health import InferenceHealth, out_of_memory


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
