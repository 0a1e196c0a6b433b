"""Restart policy of a supervised actor (pure: the caller passes the clock reading).

Capped exponential backoff between restarts, and a restart intensity limit in the manner of Erlang/OTP:
more than `max_restarts` crashes within `window_s` seconds and the actor is given up for good.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Restart:
    delay_s: float
    crashes_in_window: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    crashes_in_window: int


@dataclass(slots=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 60.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0
    _crashes: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_initial_s < 0:
            raise ValueError("restart policy needs max_restarts >= 0, window_s > 0, backoff_initial_s >= 0")

    def on_crash(self, now: float) -> Restart | GiveUp:
        """Records a crash at `now` and says what to do next."""
        self._crashes.append(now)
        while self._crashes and self._crashes[0] <= now - self.window_s:
            self._crashes.popleft()
        count = len(self._crashes)
        if count > self.max_restarts:
            return GiveUp(count)
        delay = min(self.backoff_max_s, self.backoff_initial_s * (2 ** (count - 1)))
        return Restart(delay, count)
