"""Health by inference: is a ready server still able to complete? (runner core, pure).

`/health` answers while the server can no longer generate (a wedged backend, a broken device), so liveness also
needs completions. Rules this module keeps:

* Every real completion is evidence: one that finished is a success, one the server failed (5xx, a dropped
  connection, no answer) a failure; a client's own mistakes (4xx) say nothing about the server.
* When no completion succeeded for `probe_interval_s`, the runner sends a probe (one token, nothing cached) on
  an idle server; a probe is never sent while a slot is busy (it would wait behind that generation and time
  out for no fault of the server).
* `failures` consecutive failures, probes and real completions alike, make the server a crash; one success
  clears them.
* An out-of-memory death is told apart from other crashes by what the server printed last (its allocation
  failure lines) or a SIGKILL, which is what the kernel's OOM killer sends, unless the runner sent that SIGKILL
  itself (a server that SIGTERM did not stop, such as a hung one).
* No clock, no I/O: times are passed in.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Final

__all__ = ["OOM_MARKERS", "InferenceHealth", "out_of_memory"]

#: What llama.cpp prints when an allocation fails (CPU and GPU backends).
OOM_MARKERS: Final = (
    "failed to allocate",
    "out of memory",
    "cudaMalloc failed",
    "ErrorOutOfDeviceMemory",
    "std::bad_alloc",
    "unable to allocate",
)


@dataclass
class InferenceHealth:
    probe_interval_s: float = 30.0
    failures: int = 3
    _last_success: float = field(default=-1e18)
    _consecutive: int = 0
    _last_probe: float = field(default=-1e18)
    last_failure: str = ""

    def started(self, now: float) -> None:
        """The server became ready: it counts as healthy from now."""
        self._last_success = now
        self._consecutive = 0
        self.last_failure = ""

    def success(self, now: float) -> None:
        self._last_success = now
        self._consecutive = 0

    def failure(self, now: float, why: str) -> bool:
        """Records a failed completion; True when the server is to be treated as crashed."""
        del now
        self._consecutive += 1
        self.last_failure = why
        return self._consecutive >= self.failures

    def should_probe(self, now: float, *, busy: bool) -> bool:
        if busy:
            return False
        due = now - max(self._last_success, self._last_probe) >= self.probe_interval_s
        if due:
            self._last_probe = now
        return due

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive


def out_of_memory(exit_code: int | None, log_tail: str, *, killed_by_runner: bool = False) -> bool:
    """Whether a server's death looks like running out of memory. `killed_by_runner`: the runner itself sent
    SIGKILL, so a SIGKILL exit is its own doing, not the kernel's."""
    text = log_tail.lower()
    if any(marker.lower() in text for marker in OOM_MARKERS):
        return True
    return exit_code == -signal.SIGKILL and not killed_by_runner
