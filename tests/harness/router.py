"""The router under test: an instance reported ready."""

from __future__ import annotations

from pathlib import Path

from actors.placement.geometry import geometry_from_header
from actors.placement.gguf_header import read_header
from actors.placement.memory import estimate
from messages.placement import Stamp
from messages.runner import InstanceState, InstanceStatus
from messages.settings import ServingSettings
from messages.subjects import Subjects
from runtime import buckets
from runtime.bus import Bus, encode

SUBJECTS = Subjects()


async def ready_instance(
    bus: Bus, model: Path, instance: str = "i1", node: str = "n1", state: InstanceState = "ready"
) -> None:
    """A ready instance's record of `model` (1 slot; the router takes the slots from a current load report), or
    its record in another `state`."""
    settings = ServingSettings(slots=1)
    record = InstanceStatus(
        id=instance, node=node, reservation_id=f"r-{instance}", state=state, port=1234, model_path=str(model),
        settings=Stamp(settings=settings, ctx=512, n_gpu_layers=0),
        predicted_memory=estimate(geometry_from_header(read_header(model)), settings, 512),
    )  # fmt: skip
    kv = await buckets.instances(bus, SUBJECTS)
    await kv.put(SUBJECTS.instance_key(node, instance), encode(record))
