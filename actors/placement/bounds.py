"""Per-model serving settings within a node's bounds (placement core, pure; the runner's drift check uses it).

Rules this module keeps:

* A model's settings are the node's advertised defaults with the fields a request (or a front-door catalog
  entry) asks for put in their place (`effective`); only the per-model fields (`messages.settings.PER_MODEL`)
  can be asked for. What runs is exactly that: admission sizes it, the stamp records it, the runner pins it.
* A node bounds what it accepts (`SettingsBounds`): the most slots, the cache types, flash attention,
  unified KV, full SWA, the speculation types and draft depth. `out_of_bounds` names each bound a setting
  breaks, so a refusal says which bound refused and what it allows.
* A node that advertises no bounds (an older node) accepts only its own settings: a request for anything
  else is out of its bounds, as `settings_mismatch` was before bounds existed.
* `invalid` says what llama-server itself would refuse (a quantized V cache without flash attention, an
  unknown speculation type, a pooling that does not go with the model's kind), whatever the bounds.
* An embedding or rerank model's batch sizes are its own (a whole input, `actors.placement.pooled`), not the
  node's: they are not compared with the node's defaults.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from actors.placement import pooled
from actors.placement.context import SPEC_TYPES
from messages.placement import PreferredSettings
from messages.settings import PER_MODEL, ServingSettings, SettingsBounds

__all__ = ["effective", "invalid", "out_of_bounds"]

_UNQUANTIZED = frozenset({"f32", "f16", "bf16"})
#: The node's own settings that an embedding or rerank model sets for itself: its batch holds a whole input.
_POOLED_OWN = ("batch", "ubatch")


def effective(defaults: ServingSettings, wanted: PreferredSettings | None) -> ServingSettings:
    """The settings a model runs with on a node whose defaults are `defaults`."""
    if wanted is None:
        return defaults
    changes = {name: getattr(wanted, name) for name in PER_MODEL if getattr(wanted, name, None) is not None}
    return msgspec.structs.replace(defaults, **changes) if changes else defaults


def _spec_types(settings: ServingSettings) -> list[str]:
    return [t.strip() for t in settings.spec_type.split(",") if t.strip()]


def _breaks(settings: ServingSettings, bounds: SettingsBounds) -> Iterator[tuple[str, str]]:
    if settings.slots > bounds.max_slots:
        yield "slots", f"slots {settings.slots} over max_slots {bounds.max_slots}"
    for name in ("cache_type_k", "cache_type_v", "spec_draft_type_k", "spec_draft_type_v"):
        value = getattr(settings, name)
        if value not in bounds.cache_types:
            yield name, f"{name} {value} not in cache_types ({', '.join(bounds.cache_types)})"
    if settings.flash_attn not in bounds.flash_attn:
        yield "flash_attn", f"flash_attn {settings.flash_attn} not in flash_attn ({', '.join(bounds.flash_attn)})"
    if settings.kv_unified not in bounds.kv_unified:
        yield "kv_unified", f"kv_unified {str(settings.kv_unified).lower()} not allowed"
    if settings.swa_full not in bounds.swa_full:
        yield "swa_full", f"swa_full {str(settings.swa_full).lower()} not allowed"
    if bounds.spec_types is not None:
        allowed = set(bounds.spec_types) | {"none"}
        for spec in _spec_types(settings):
            if spec not in allowed:
                yield "spec_type", f"spec_type {spec} not in spec_types ({', '.join(bounds.spec_types) or 'none'})"
    if settings.kind not in bounds.kinds:
        yield "kind", f"kind {settings.kind} not in kinds ({', '.join(bounds.kinds)})"
    if settings.spec_type != "none" and settings.spec_draft_n_max > bounds.max_spec_draft_n_max:
        yield (
            "spec_draft_n_max",
            (f"spec_draft_n_max {settings.spec_draft_n_max} over max_spec_draft_n_max {bounds.max_spec_draft_n_max}"),
        )


def out_of_bounds(
    settings: ServingSettings, defaults: ServingSettings, bounds: SettingsBounds | None
) -> tuple[tuple[str, ...], str]:
    """The fields of `settings` that a node with these `defaults` and `bounds` does not accept, and a message
    naming each bound that refused (empty when it accepts them all). The node's own fields must equal its
    defaults: a model cannot change them."""
    fields: list[str] = []
    messages: list[str] = []
    own = _POOLED_OWN if settings.kind in pooled.POOLED_KINDS else ()
    for name in ServingSettings.__struct_fields__:
        if name in own:
            continue
        fixed = name not in PER_MODEL or bounds is None
        if fixed and getattr(settings, name) != getattr(defaults, name):
            fields.append(name)
            why = "the node's own setting" if name not in PER_MODEL else "the node advertises no bounds"
            messages.append(f"{name}: node {getattr(defaults, name)!r}, required {getattr(settings, name)!r} ({why})")
    if bounds is not None:
        for name, message in _breaks(settings, bounds):
            if name not in fields:
                fields.append(name)
            messages.append(message)
    return tuple(fields), "; ".join(messages)


def invalid(settings: ServingSettings) -> str | None:
    """Why llama-server would refuse these settings (None: it takes them)."""
    if settings.flash_attn != "on":
        for name in ("cache_type_v", "spec_draft_type_v"):
            if getattr(settings, name) not in _UNQUANTIZED:
                return f"{name} {getattr(settings, name)}: a quantized V cache needs flash_attn on"
    unknown = [t for t in _spec_types(settings) if t not in SPEC_TYPES]
    if unknown:
        return f"unknown spec_type {', '.join(unknown)} (accepted: {', '.join(sorted(SPEC_TYPES))})"
    return pooled.settings_refusal(settings)
