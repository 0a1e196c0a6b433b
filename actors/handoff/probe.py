"""Link probe: how long a handoff from this node to a peer takes, measured with real handoffs.

`mesh.handoff.<node>.probe` (`LinkProbe`, an operator's request: node credentials may not send it) makes
this node's handoff actor send one untimed handoff of `bytes` (a warm-up: the first handoffs measured
25-65% slower than the next), then `rounds` handoffs of `small_bytes` and of `bytes` to the peer, with the full
protocol (credits, per-segment blake3, the commit's checks) and payload kind `link_probe`, which the peer
verifies and throws away. The (bytes, seconds) samples, open to result, are fitted to
`seconds = fixed_s + bytes / bytes_per_s` (`cost.fit_link`), answered, and journaled as `link_measured`,
which every router learns from (`actors/router/links.py`). The bytes are random (nothing on the way
compresses them), one buffer reused for every segment.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Final, Protocol

import blake3

from actors.handoff import cost
from actors.handoff.api import HandoffFailed, HandoffReport
from actors.l3 import layout
from messages.errors import BAD_REQUEST, UNAVAILABLE
from messages.events import LinkMeasured
from messages.handoff import PROBE_PAYLOAD_KIND, LinkProbe, LinkProbeResult
from runtime.actor import ActorContext, RequestError

__all__ = ["PROBE_IDENTITY", "Sender", "blocks", "probe"]


class Sender(Protocol):
    """What a probe needs of the handoff actor: its node id, and a handoff sent with the full protocol."""

    node_id: str

    async def send(
        self,
        peer: str,
        source: AsyncIterable[bytes],
        *,
        identity: str,
        n_tokens: int,
        payload_kind: str,
        max_bytes: int | None,
    ) -> HandoffReport: ...


#: The identity probes carry: no model's, so no store or server ever takes the payload.
PROBE_IDENTITY: Final = blake3.blake3(b"mesh-actor/handoff/link-probe/v1").hexdigest()


async def probe(actor: Sender, ctx: ActorContext, request: LinkProbe) -> LinkProbeResult:
    if request.peer == actor.node_id:
        raise RequestError(BAD_REQUEST, "a node does not probe a link to itself", {"path": "peer"})
    segment = min(request.bytes, layout.DEFAULT_SEGMENT_BYTES)
    block = os.urandom(segment)
    samples: list[tuple[int, float]] = []
    paths: set[str] = set()
    # The first handoff is not timed: it pays once for what later ones reuse (buffers, staging pages).
    sizes = [request.bytes] + [size for _ in range(request.rounds) for size in (request.small_bytes, request.bytes)]
    for i, size in enumerate(sizes):
        started = time.perf_counter()
        try:
            report = await actor.send(
                request.peer,
                blocks(block, size),
                identity=PROBE_IDENTITY,
                n_tokens=0,
                payload_kind=PROBE_PAYLOAD_KIND,
                max_bytes=size,
            )
        except HandoffFailed as exc:
            raise RequestError(UNAVAILABLE, f"probe handoff to {request.peer} failed: {exc}") from exc
        if i > 0:
            samples.append((size, time.perf_counter() - started))
            paths.add(report.transport)
    link = cost.fit_link(samples)
    assert link is not None  # every sample has bytes and a positive time
    transport = "+".join(sorted(paths))  # the path the measured handoffs took: the rate is that path's
    ctx.emit(
        LinkMeasured,
        src=actor.node_id,
        dst=request.peer,
        bytes_per_s=link.bytes_per_s,
        fixed_s=link.fixed_s,
        samples=tuple(samples),
        transport=transport,
    )
    return LinkProbeResult(
        src=actor.node_id,
        dst=request.peer,
        bytes_per_s=link.bytes_per_s,
        fixed_s=link.fixed_s,
        samples=tuple(samples),
        transport=transport,
    )


async def blocks(block: bytes, total: int) -> AsyncIterator[bytes]:
    """`total` bytes as segments of `block` (the last one cut short)."""
    sent = 0
    while sent < total:
        n = min(len(block), total - sent)
        yield block if n == len(block) else block[:n]
        sent += n
