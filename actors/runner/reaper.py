"""Making sure a server is gone before anyone is told so (runner shell).

A server's memory is free only once its process has exited and been reaped, and placement credits the memory
back on the runner's word. So `reap` returns only when the process is confirmed reaped: SIGTERM, SIGKILL
after the stop grace, then SIGKILL again every `kill_retry_s` for as long as it takes (or, when the runner
itself is stopping, for a bounded patience). Every wait is bounded; `on_stuck` is told after each SIGKILL
that did not reap it, so the stuck state is reported (and its record kept alive) while the memory stays
held. The lifecycle machine follows the same rule for the stops it drives; this is for the driver's own
end (the runner stopping, or the driver failing).

Cancelled (asked to hurry), it sends SIGKILL and re-raises without a confirmation: the caller then reports
nothing final.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from actors.runner.instance_lifecycle import Timings
from actors.runner.process import ServerProcess

__all__ = ["reap"]


async def reap(
    process: ServerProcess,
    send: Callable[[signal.Signals], None],
    timings: Timings,
    on_stuck: Callable[[str], Awaitable[None]],
    *,
    graceful: bool = True,
    patience_s: float | None = None,
) -> int | None:
    """Stops `process` (signals go through `send`; `graceful=False` skips SIGTERM) and returns its exit code
    once it is reaped. `on_stuck` is awaited after each SIGKILL that did not reap it (to report the stuck
    state and keep its record alive). None only when `patience_s` passed first: it may still be alive."""
    if process.returncode is not None:
        return process.returncode
    loop = asyncio.get_running_loop()
    give_up = None if patience_s is None else loop.time() + patience_s
    try:
        if graceful:
            send(signal.SIGTERM)
            code = await process.wait_for(timings.stop_grace_s)
            if code is not None:
                return code
        send(signal.SIGKILL)
        code = await process.wait_for(timings.kill_grace_s)
        while code is None:
            await on_stuck(
                f"llama-server (pid {process.pid}) did not exit within {timings.kill_grace_s:g}s of SIGKILL; "
                f"SIGKILL again every {timings.kill_retry_s:g}s, its memory stays held"
            )
            if give_up is not None and loop.time() >= give_up:
                return None
            send(signal.SIGKILL)
            code = await process.wait_for(timings.kill_retry_s)
        return code
    except asyncio.CancelledError:
        send(signal.SIGKILL)
        raise
