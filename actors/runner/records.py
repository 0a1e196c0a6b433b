"""Instance records (runner shell): each instance's `InstanceStatus` in the instances bucket, with a TTL.

Key = `<node>.<instance id>` (nats-server lets a node write only its own keys). A record is rewritten on every
change and refreshed while its driver lives, with a per-key TTL (`status_ttl_s`, 30 s) so the records of a
runner that died disappear by themselves; a final one (stopped, failed, rejected) is kept `final_ttl_s`
(600 s). Placement's reconcile loop reads them to release memory without depending on the journal, so a
final record is written only once the server is gone.
"""

from __future__ import annotations

import nats.errors

from messages.runner import InstanceStatus
from runtime.actor import ActorContext
from runtime.buckets import TTL_HEADER
from runtime.bus import encode

__all__ = ["FINAL_STATES", "TTL_HEADER", "write_status"]

FINAL_STATES = frozenset({"stopped", "failed", "rejected"})


async def write_status(
    ctx: ActorContext, status: InstanceStatus, *, live_ttl_s: float, final_ttl_s: float, timeout_s: float
) -> bool:
    """Puts the record; False (logged) when NATS is away: the next change or refresh writes it again."""
    ttl = final_ttl_s if status.state in FINAL_STATES else live_ttl_s
    try:
        await ctx.bus.js.publish(
            f"$KV.{ctx.subjects.instances_bucket}.{ctx.subjects.instance_key(status.node, status.id)}",
            encode(status),
            timeout=timeout_s,
            headers={TTL_HEADER: f"{max(1, round(ttl))}s"},
        )
    except (nats.errors.Error, TimeoutError) as exc:
        ctx.log.warning("instance_status_not_written", instance=status.id, error=str(exc) or type(exc).__name__)
        return False
    return True
