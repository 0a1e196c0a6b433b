"""Settings drift: where what would run (or what runs) differs from the stamp (runner core).

Two checks, each returning one `FieldDrift` per differing field (empty when everything agrees):

* `settings_drift`, before start: the stamp against the node's current serving settings, bounds and engine
  build. Admission sized the instance for the stamped settings; a model's own settings must still be within
  the node's bounds, and the node's own (batch sizes, host-RAM extras, threads) still equal its current ones.
  If the node has since been reconfigured (or its llama-server replaced), starting it would run something
  nobody admitted.
* `split_drift`, after start of a split instance: each member's buffers, as the head's log prints them, against
  the prediction (the layers each member holds are the stamped ones, and its compute stays within what it booked).
* `server_drift`, after start: the running server against the stamp, from what it reports about itself.
  `/props` gives the slot count (`total_slots`) and the per-slot context (`default_generation_settings.n_ctx`);
  `/slots` lists every slot with its context and whether it can speculate. This build's `/props` does not
  describe speculation (its `speculative.types` is a default-constructed request field, always "none"), so
  the speculative type and draft length come from the server's log, which also gives the resolved context
  (n_ctx, streams, micro-batch, rollback rows), unified KV, flash attention and every cache's element types;
  for an embedding or rerank server also its batch and that every token of it is an output (embeddings on);
  with a multimodal projector (`--mmproj`), that one was loaded, of the stamped type, on the host or a GPU as
  admission placed it.

Field names say where the current value was read: `props.*`, `slots.*`, `log.*`; before start they are the
`ServingSettings` field names. Values are rendered as text (`true`/`false` for booleans). Pure core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

from actors.placement.bounds import out_of_bounds
from actors.placement.pooled import POOLED_KINDS
from actors.placement.projector import projector_device
from actors.runner.allocation_log import AllocationLog, printed_mib, remote_devices
from messages.memory import ContextShape, MemoryBreakdown
from messages.placement import Stamp
from messages.runner import FieldDrift
from messages.settings import PER_MODEL, ServingSettings, SettingsBounds

__all__ = ["ServerReport", "server_drift", "settings_drift", "speculative_types", "split_drift"]

_MISSING = "(missing)"


def _text(value: object) -> str:
    if value is None:
        return _MISSING
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def speculative_types(settings: ServingSettings) -> tuple[str, ...]:
    """The speculative implementations `--spec-type` asks for ("none" and blanks dropped), in order."""
    return tuple(t.strip() for t in settings.spec_type.split(",") if t.strip() and t.strip() != "none")


def settings_drift(
    stamp: Stamp,
    current: ServingSettings | None,
    *,
    engine_version: str | None = None,
    bounds: SettingsBounds | None = None,
) -> tuple[FieldDrift, ...]:
    """Where the stamped settings leave what the node now accepts (its settings and `bounds`; None: a node
    without bounds accepts only its own settings), and its engine build."""
    out: list[FieldDrift] = []
    if current is None:
        out.append(FieldDrift(field="settings", stamped="advertised", current="not advertised"))
    else:
        fields, _ = out_of_bounds(stamp.settings, current, bounds)
        for name in fields:
            stamped = getattr(stamp.settings, name)
            now = getattr(current, name) if name not in PER_MODEL or bounds is None else "outside the node's bounds"
            out.append(FieldDrift(field=name, stamped=_text(stamped), current=_text(now)))
    if stamp.llama_server_version is not None and engine_version != stamp.llama_server_version:
        out.append(
            FieldDrift(field="llama_server_version", stamped=stamp.llama_server_version, current=_text(engine_version))
        )
    return tuple(out)


@dataclass(frozen=True)
class ServerReport:
    """What a running server says about itself: `/props` and `/slots` as decoded JSON, and its parsed log."""

    props: object
    slots: object
    log: AllocationLog


class _Diff:
    def __init__(self) -> None:
        self.items: list[FieldDrift] = []

    def check(self, field: str, stamped: object, current: object) -> None:
        # bool is an int in Python: a JSON `true` must not pass for the slot count 1
        if stamped != current or isinstance(stamped, bool) != isinstance(current, bool):
            self.items.append(FieldDrift(field=field, stamped=_text(stamped), current=_text(current)))


def _get(obj: object, *path: str) -> object:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def server_drift(stamp: Stamp, shape: ContextShape, report: ServerReport) -> tuple[FieldDrift, ...]:
    """Differences between the stamp (with the context it resolves to, `shape`) and the running server."""
    s = stamp.settings
    types = speculative_types(s)
    diff = _Diff()

    diff.check("props.total_slots", s.slots, _get(report.props, "total_slots"))
    diff.check("props.n_ctx_per_slot", shape.n_ctx_seq, _get(report.props, "default_generation_settings", "n_ctx"))

    slots = report.slots if isinstance(report.slots, Sequence) and not isinstance(report.slots, str) else None
    if slots is None:
        diff.check("slots", "a list", type(report.slots).__name__)
    else:
        diff.check("slots.count", s.slots, len(slots))
        contexts = sorted({_text(_get(slot, "n_ctx")) for slot in slots})
        if contexts and contexts != [str(shape.n_ctx_seq)]:
            diff.check("slots.n_ctx", str(shape.n_ctx_seq), ",".join(contexts))
        speculating = sorted({_text(_get(slot, "speculative")) for slot in slots})
        if speculating and speculating != [_text(bool(types))]:
            diff.check("slots.speculative", _text(bool(types)), ",".join(speculating))

    log = report.log
    target = log.target
    if target is None:
        diff.check("log.context", "logged", "not logged")
        return tuple(diff.items)
    diff.check("log.n_ctx", shape.n_ctx, target.n_ctx)
    diff.check("log.n_ctx_seq", shape.n_ctx_seq, target.n_ctx_seq)
    diff.check("log.n_seq_max", shape.n_seq_max, target.n_seq_max)
    diff.check("log.n_ubatch", shape.n_ubatch, target.n_ubatch)
    if s.kind in POOLED_KINDS:
        # an embedding or rerank server: its batch (a whole input), every token of it an output, which llama-server
        # sets up only with --embeddings (or a pooling): its output limit is then the whole batch
        diff.check("log.n_batch", s.batch, target.n_batch)
        diff.check("log.n_outputs_max", s.batch, target.n_outputs_max)
    diff.check("log.n_rs_seq", shape.n_rs_seq, target.n_rs_seq)
    diff.check("log.kv_unified", s.kv_unified, target.kv_unified)
    flash = {"enabled": "on", "disabled": "off"}.get(target.flash_attn or "", target.flash_attn)
    diff.check("log.flash_attn", s.flash_attn, flash)
    for line in target.kv:
        diff.check("log.cache_type_k", s.cache_type_k, line.k_type)
        diff.check("log.cache_type_v", s.cache_type_v, line.v_type)
    draft_wanted = "draft-mtp" in types or stamp.draft is not None  # an MTP context, or a draft model's
    diff.check("log.draft_context", draft_wanted, log.draft is not None)
    if log.draft is not None:
        for line in log.draft.kv:
            diff.check("log.spec_draft_type_k", s.spec_draft_type_k, line.k_type)
            diff.check("log.spec_draft_type_v", s.spec_draft_type_v, line.v_type)
    projector = log.projector
    diff.check("log.mmproj", stamp.mmproj is not None, projector is not None)
    if stamp.mmproj is not None and projector is not None:
        offloaded = projector_device(stamp.n_gpu_layers, stamp.gpu_split) >= 0
        where = None if projector.backend is None else "host" if projector.backend == "CPU" else "gpu"
        diff.check("log.mmproj_backend", "gpu" if offloaded else "host", where)
    running = sorted({i.type for i in log.speculative})
    diff.check("log.spec_type", ",".join(sorted(set(types))) or "none", ",".join(running) or "none")
    for impl in log.speculative:
        if impl.type.startswith("draft-") and impl.n_max is not None:
            diff.check("log.spec_draft_n_max", s.spec_draft_n_max, impl.n_max)
    # one line per field is enough to act on; repeated cache lines would only repeat it
    unique: dict[tuple[str, str, str], FieldDrift] = {}
    for item in diff.items:
        unique.setdefault((item.field, item.stamped, item.current), item)
    return tuple(unique.values())


def split_drift(
    stamp: Stamp, predicted: MemoryBreakdown, endpoints: Sequence[str], log: AllocationLog
) -> tuple[FieldDrift, ...]:
    """A split instance's members against the prediction, from the head's log (its `RPC<d>[HOST:PORT]` lines;
    `endpoints` are the `--rpc` endpoints in the stamp's member order, so member `i` is the predicted device
    `RPC<i>`). Each member's model buffer and caches must print as predicted (the layers it holds are the
    stamped ones) and its compute buffer must stay within its prediction and margin (what its ledger booked).
    Field names: `log.split.<member>.model_mib`, `.cache_mib`, `.compute_mib`."""
    diff = _Diff()
    printed = {device.endpoint: device for device in remote_devices(log).values()}
    devices = {device.device: device for device in predicted.devices}
    diff.check("log.split.members", len(stamp.rpc), len(printed))
    for index, (member, endpoint) in enumerate(zip(stamp.rpc, endpoints, strict=True)):
        field = f"log.split.{member.node_id}"
        want, got = devices.get(f"RPC{index}"), printed.get(endpoint)
        if want is None or got is None:
            diff.check(field, "predicted and allocated", f"predicted {want is not None}, allocated {got is not None}")
            continue
        diff.check(f"{field}.model_mib", printed_mib(want.weights_bytes), got.model_mib)
        caches = want.kv_bytes + want.recurrent_bytes
        # each cache line rounds on its own: the sum may differ from the sum's rounding by a step per line
        slack = Decimal("0.01") * max(1, len(got.cache_mib))
        if abs(got.caches_mib - printed_mib(caches)) > slack:
            diff.check(f"{field}.cache_mib", printed_mib(caches), got.caches_mib)
        booked = want.compute_bytes + want.compute_margin_bytes
        if got.compute_mib is None or got.compute_mib > printed_mib(booked):
            diff.check(f"{field}.compute_mib", f"at most {printed_mib(booked)}", got.compute_mib)
    return tuple(diff.items)
