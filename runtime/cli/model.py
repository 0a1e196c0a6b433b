"""Model commands (`inspect`, `fit`): offline, no bus.

`mesh-actor inspect MODEL.gguf` prints a model's geometry (architecture, one row per block: attention,
recurrent, sliding-window, nextn; KV and state widths; tensor bytes). `mesh-actor fit MODEL.gguf …` prints
what llama-server would allocate with the given settings, per device and in total, and with `--memory` the
largest context that fits (`--mmproj` adds a multimodal projector). Flags and defaults are llama-server's own.
Errors are one line on stderr: exit code 2 for a usage problem, 1 for a model that cannot be read, is not
supported or cannot be served so.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from actors.placement import pooled
from actors.placement.bounds import effective
from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, read_header
from actors.placement.memory import (
    CACHE_TYPES,
    SPEC_TYPES,
    Budgets,
    MemoryModelError,
    estimate,
)
from actors.placement.projector import ProjectorError, projector_from_header
from actors.telemetry.probes import read_host
from actors.telemetry.resources import ggml_cpu_features
from messages.memory import MemoryBreakdown
from messages.model import ModelGeometry
from messages.placement import PreferredSettings
from messages.settings import ServingSettings
from runtime.sizes import format_size, parse_size

EXIT_MODEL = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    pass


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _sizes(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    try:
        return tuple(parse_size(part) for part in parts)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _spec_type(text: str) -> str:
    for part in text.split(","):
        if part.strip() not in SPEC_TYPES:
            raise argparse.ArgumentTypeError(
                f"unknown speculative type {part.strip()!r} (accepted: {', '.join(sorted(SPEC_TYPES))})"
            )
    return text


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Adds `inspect` and `fit`."""
    inspect = sub.add_parser("inspect", help="print a GGUF model's geometry (layers, KV and state widths)")
    inspect.add_argument("model", metavar="MODEL.gguf")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=run_inspect)

    fit = sub.add_parser("fit", help="predict what llama-server allocates for a model, per device")
    fit.add_argument("model", metavar="MODEL.gguf")
    fit.add_argument("-c", "--ctx", "--ctx-size", dest="ctx", type=_non_negative, default=0,
                     help="total context (llama-server -c); 0: the model's training context (default)")  # fmt: skip
    fit.add_argument("-np", "--parallel", type=_positive, default=None,
                     help="slots (default: 4 with unified KV, as llama-server's auto)")  # fmt: skip
    fit.add_argument("-kvu", "--kv-unified", action="store_true", help="one KV stream shared by all slots")
    fit.add_argument("-ctk", "--cache-type-k", choices=sorted(CACHE_TYPES), default="f16")
    fit.add_argument("-ctv", "--cache-type-v", choices=sorted(CACHE_TYPES), default="f16")
    fit.add_argument("-fa", "--flash-attn", choices=("on", "off"), default="on")
    fit.add_argument("-b", "--batch-size", dest="batch", type=_positive, default=2048)
    fit.add_argument("-ub", "--ubatch", "--ubatch-size", dest="ubatch", type=_positive, default=512)
    fit.add_argument("--swa-full", action="store_true", help="full-size sliding-window cache")
    fit.add_argument("--spec-type", type=_spec_type, default="none", help="speculative decoding type")
    fit.add_argument("--spec-draft-n-max", type=_non_negative, default=3, help="draft depth (rollback rows)")
    fit.add_argument("-ctkd", "--spec-draft-type-k", choices=sorted(CACHE_TYPES), default="f16")
    fit.add_argument("-ctvd", "--spec-draft-type-v", choices=sorted(CACHE_TYPES), default="f16")
    fit.add_argument("-ctxcp", "--ctx-checkpoints", type=_non_negative, default=32)
    fit.add_argument("-cram", "--cache-ram", type=_integer, default=8192, help="prompt cache MiB (-1: no limit)")
    fit.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=_integer, default=-1,
                     help="layers on GPUs (-1: all); 0 makes --memory the host budget")  # fmt: skip
    fit.add_argument("--memory", type=_sizes, default=None, metavar="SIZE[,SIZE...]",
                     help="budget per GPU, e.g. 24GiB,8GiB (with -ngl 0: the host budget)")  # fmt: skip
    fit.add_argument("--host-memory", type=_size, default=None, metavar="SIZE", help="host RAM budget")
    fit.add_argument(
        "--cpu-features",
        type=_features,
        default=None,
        metavar="NAME[,NAME...]",
        help="llama.cpp CPU features of the node (decide which weights the CPU backend repacks; "
        "default: this host's; 'unknown' for the upper bound)",
    )
    fit.add_argument("--kind", choices=("generate", "embedding", "rerank"), default=None,
                     help="what the server is for (default: what the header's pooling type says)")  # fmt: skip
    fit.add_argument("--pooling", choices=("none", "mean", "cls", "last", "rank"), default=None,
                     help="an embedding or rerank server's pooling (default: the header's, else mean)")  # fmt: skip
    fit.add_argument("--mmproj", metavar="MMPROJ.gguf", default=None,
                     help="a multimodal projector served beside the model (a LLaVA 'mlp' projector)")  # fmt: skip
    fit.add_argument("--json", action="store_true", help="print one JSON object")
    fit.set_defaults(func=run_fit)


def _fail(code: int, message: str) -> int:
    print(f"mesh-actor: error: {message}", file=sys.stderr)
    return code


def _load(path: str) -> ModelGeometry:
    return geometry_from_header(read_header(path))


def _model_error(path: str, exc: Exception) -> int:
    if isinstance(exc, OSError):
        return _fail(EXIT_MODEL, f"cannot read {path}: {exc.strerror or exc}")
    return _fail(EXIT_MODEL, f"{path}: {exc}")


def run_inspect(args: argparse.Namespace) -> int:
    try:
        geometry = _load(args.model)
    except (OSError, GGUFFormatError, GeometryError) as exc:
        return _model_error(args.model, exc)
    if args.json:
        print(msgspec.json.encode(geometry).decode())
        return 0
    print(_inspect_table(geometry))
    return 0


def _kind(attention: bool, recurrent: bool) -> str:
    if attention and recurrent:
        return "attention+recurrent"
    if attention:
        return "attention"
    if recurrent:
        return "recurrent"
    return "-"


def _inspect_table(g: ModelGeometry) -> str:
    n_attn = sum(1 for layer in g.layers if layer.attention)
    n_recr = sum(1 for layer in g.layers if layer.recurrent)
    n_swa = sum(1 for layer in g.layers if layer.swa)
    lines = [
        f"architecture  {g.architecture}",
        f"layers        {g.n_layer} ({g.n_layer_nextn} nextn): {n_attn} attention, {n_recr} recurrent, {n_swa} SWA",
        f"embedding     {g.n_embd}   vocab {g.n_vocab}   trained context {g.n_ctx_train}",
        f"sliding win.  {g.n_swa if g.swa_type != 'none' else '-'} ({g.swa_type})   MLA {'yes' if g.mla else 'no'}"
        f"   rollback {'yes' if g.rollback else 'no'}   MTP context {'yes' if g.mtp_context else 'no'}",
        f"tensors       {format_size(g.input_tensor_bytes)} input, {format_size(g.output_tensor_bytes)} output"
        f"{' (tied to input)' if g.tied_output else ''}, "
        f"{format_size(sum(layer.tensor_bytes for layer in g.layers))} in blocks",
        "",
        f"{'layer':>5}  {'kind':<19} {'swa':<3} {'nextn':<5} {'kv heads':>8} {'K width':>8} {'V width':>8} "
        f"{'R width':>8} {'S width':>8} {'tensor bytes':>14}",
    ]
    for layer in g.layers:
        lines.append(
            f"{layer.index:>5}  {_kind(layer.attention, layer.recurrent):<19} {'yes' if layer.swa else '-':<3} "
            f"{'yes' if layer.nextn else '-':<5} {layer.n_head_kv:>8} {layer.k_width:>8} {layer.v_width:>8} "
            f"{layer.r_width:>8} {layer.s_width:>8} {layer.tensor_bytes:>14}"
        )
    return "\n".join(lines)


def _settings(args: argparse.Namespace) -> ServingSettings:
    slots = 4 if args.parallel is None else args.parallel
    kv_unified = True if args.parallel is None else args.kv_unified
    try:
        return ServingSettings(
            slots=slots,
            kv_unified=kv_unified,
            cache_type_k=args.cache_type_k,
            cache_type_v=args.cache_type_v,
            flash_attn=args.flash_attn,
            batch=args.batch,
            ubatch=args.ubatch,
            swa_full=args.swa_full,
            spec_type=args.spec_type,
            spec_draft_n_max=args.spec_draft_n_max,
            spec_draft_type_k=args.spec_draft_type_k,
            spec_draft_type_v=args.spec_draft_type_v,
            ctx_checkpoints=args.ctx_checkpoints,
            cache_ram_mib=args.cache_ram,
        )
    except msgspec.ValidationError as exc:
        raise _UsageError(str(exc)) from None


def _budgets(args: argparse.Namespace) -> tuple[Budgets | None, tuple[float, ...]]:
    """Budgets and the GPU split: GPUs are the --memory entries, unless -ngl 0 makes the one entry the host."""
    memory: tuple[int, ...] | None = args.memory
    if args.n_gpu_layers == 0:
        if memory is not None and len(memory) != 1:
            raise _UsageError("with --n-gpu-layers 0, --memory takes one size: the host budget")
        if memory is not None and args.host_memory is not None:
            raise _UsageError("with --n-gpu-layers 0, give the host budget once (--memory or --host-memory)")
        host = memory[0] if memory is not None else args.host_memory
        return (Budgets(host=host) if host is not None else None), ()
    gpus = memory or ()
    if not gpus and args.host_memory is None:
        return None, ()
    return Budgets(gpus=gpus, host=args.host_memory), tuple(float(b) for b in gpus)


def run_fit(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
        budgets, split = _budgets(args)
        if args.flash_attn == "off" and CACHE_TYPES[args.cache_type_v][0] > 1:
            raise _UsageError("a quantized V cache (--cache-type-v) requires --flash-attn on")
        if args.n_gpu_layers < -1:
            raise _UsageError("--n-gpu-layers must be -1 (all) or a non-negative count")
    except _UsageError as exc:
        return _fail(EXIT_USAGE, str(exc))
    projector = None
    if args.mmproj is not None:
        try:
            projector = projector_from_header(read_header(args.mmproj))
        except (OSError, GGUFFormatError, ProjectorError) as exc:
            return _model_error(args.mmproj, exc)
    try:
        geometry = _load(args.model)
        n_ctx = args.ctx or geometry.n_ctx_train
        # an embedding or rerank model is sized as placement sizes it: its kind and pooling, its whole-input batch
        asked = PreferredSettings(kind=args.kind, pooling=args.pooling)
        settings = effective(settings, pooled.resolved(None if asked == PreferredSettings() else asked, geometry))
        breakdown = estimate(
            geometry,
            settings,
            n_ctx,
            n_gpu_layers=args.n_gpu_layers,
            gpu_split=split,
            budgets=budgets,
            cpu_features=_host_features() if args.cpu_features is None else args.cpu_features or None,
            projector=projector,
        )
    except (OSError, GGUFFormatError, GeometryError, MemoryModelError) as exc:
        return _model_error(args.model, exc)
    if args.json:
        print(msgspec.json.encode(breakdown).decode())
    else:
        print(_fit_table(breakdown))
    return 0


def _features(text: str) -> tuple[str, ...]:
    """`--cpu-features`: comma-separated names, or `unknown` (an empty tuple: the upper bound)."""
    if text.strip().lower() == "unknown":
        return ()
    return tuple(name.strip().upper() for name in text.split(",") if name.strip())


def _host_features() -> tuple[str, ...] | None:
    return ggml_cpu_features(read_host().cpu_flags)


def _fit_table(b: MemoryBreakdown) -> str:
    c = b.context
    lines = [
        f"{b.architecture}: n_ctx {c.n_ctx} = {c.n_stream} stream(s) x {c.n_ctx_seq} cells, {c.n_seq_max} slot(s), "
        f"ubatch {c.n_ubatch}, rollback rows {c.n_rs_seq}" + (f", SWA cells {c.swa_cells}" if c.swa_cells else ""),
        f"estimator {b.estimator_version}, validated against {b.llama_cpp_version}",
        "",
    ]
    columns = ("weights", "copies", "KV", "recurrent", "draft KV", "compute", "margin", "output", "host extra", "total")
    header = f"{'device':<8}" + "".join(f"{name:>13}" for name in columns) + f"{'budget':>13}  fits"
    lines.append(header)
    for d in b.devices:
        values = (
            d.weights_bytes,
            d.repack_bytes + d.amx_bytes,
            d.kv_bytes,
            d.recurrent_bytes,
            d.draft_kv_bytes,
            d.compute_bytes,
            d.compute_margin_bytes,
            d.output_bytes,
            d.host_extra_bytes,
            d.total_bytes,
        )
        budget = format_size(d.budget_bytes) if d.budget_bytes is not None else "-"
        fits = "-" if d.fits is None else ("yes" if d.fits else "NO")
        lines.append(f"{d.device:<8}" + "".join(f"{format_size(v):>13}" for v in values) + f"{budget:>13}  {fits}")
    totals = (
        b.weights_bytes,
        b.repack_bytes + b.amx_bytes,
        b.kv_bytes,
        b.recurrent_bytes,
        b.draft_kv_bytes,
        b.compute_bytes,
        b.compute_margin_bytes,
        b.output_bytes,
        b.host_extra_bytes,
        b.total_bytes,
    )
    lines.append(f"{'total':<8}" + "".join(f"{format_size(v):>13}" for v in totals))
    lines.append("")
    lines.append(
        f"exact: KV {b.kv_bytes} B, recurrent {b.recurrent_bytes} B, draft KV {b.draft_kv_bytes} B, "
        f"weights {b.weights_bytes} B, copies: repack {b.repack_bytes} B, AMX {b.amx_bytes} B; "
        f"compute modelled, with a margin of its "
        f"measured error bound ({b.compute_error_ratio:.0%}: {b.compute_margin_bytes} B) included in the total"
    )
    if b.projector_weights_bytes:
        where = next(d.device for d in b.devices if d.projector_weights_bytes)
        lines.append(
            f"projector ({where}): weights {b.projector_weights_bytes} B (in the total), its image graph "
            f"{b.projector_compute_bytes} B of the compute (reserved at the first image)"
        )
    if b.fits is not None:
        ceiling = f"{b.max_context} tokens" if b.max_context else "none (even the smallest context does not fit)"
        lines.append(f"fits: {'yes' if b.fits else 'NO'}; largest context that fits: {ceiling}")
    return "\n".join(lines)
