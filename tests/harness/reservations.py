"""Reservations and their records, built for pure tests of booking and admission."""

from __future__ import annotations

import msgspec

from messages.memory import ContextShape, DeviceMemory, MemoryBreakdown
from messages.placement import Reservation, ReservationState, Stamp
from messages.runner import InstanceState, InstanceStatus, ObservedMemory
from messages.settings import ServingSettings

GIB = 1 << 30


T0 = 5_000.0  # our monotonic clock when the reservation was first seen


STARTED = 1_700_000_000.0  # the node process's start time, on the node's clock


def device() -> DeviceMemory:
    return DeviceMemory(
        device="CPU", weights_bytes=0, kv_bytes=0, recurrent_bytes=0, draft_kv_bytes=0, compute_bytes=0,
        output_bytes=0, host_extra_bytes=100, total_bytes=2 * GIB,
    )  # fmt: skip


def _zeros(struct: type, **given: object) -> dict[str, object]:
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name: 0 for f in info.fields if f.required} | given


PREDICTED = msgspec.convert(
    _zeros(
        MemoryBreakdown,
        estimator_version="test",
        llama_cpp_version="test",
        architecture="llama",
        context=_zeros(ContextShape),
        devices=[],
        compute_error_ratio=0.0,
    ),
    MemoryBreakdown,
)


def reservation(
    rid: str = "r1", state: ReservationState = "reserved", instance: str | None = None, **fields: object
) -> Reservation:
    base = Reservation(
        reservation_id=rid,
        decision_id="d",
        node_id="a",
        state=state,
        model_path="m.gguf",
        stamp=Stamp(settings=ServingSettings(), ctx=4096, n_gpu_layers=0),
        layers=(0, 8),
        devices=(device(),),
        held={"CPU": 2 * GIB},
        created_at=1_000_000.0,  # the booking actor's wall clock: never compared with anything here
        expires_at=1_000_060.0,
        hold_s=60.0,
        instance_id=instance,
    )
    return msgspec.structs.replace(base, **fields)


def record(instance: str, state: InstanceState, *, rid: str = "r1", observed: int | None = None) -> InstanceStatus:
    memory = None
    if observed is not None:
        memory = ObservedMemory(
            kv_bytes=0, recurrent_bytes=0, draft_kv_bytes=0, weights_bytes=0, compute_bytes=0, output_bytes=0,
            total_bytes=observed,
        )  # fmt: skip
    return InstanceStatus(
        id=instance,
        node="a",
        reservation_id=rid,
        state=state,
        port=None,
        model_path="m.gguf",
        settings=Stamp(settings=ServingSettings(), ctx=4096, n_gpu_layers=0),
        predicted_memory=PREDICTED,
        observed_memory=memory,
        updated_at=STARTED + 500,  # the node's clock
    )
