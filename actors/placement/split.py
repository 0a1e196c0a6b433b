"""Split placement (placement core, pure): a model no single node can hold, run over several nodes with llama.cpp's
RPC backend. Admission asks for a split only when the request allows one and no node fits alone.

Rules this module keeps:
- The head runs llama-server; each member lends its host memory as one RPC device (its `ggml-rpc-server` runs
  with `-d CPU`). llama.cpp puts RPC devices first in its device list, offloads the last `-ngl` of the
  n_layer + 1 layers (the blocks, then the output layer) and splits them over the devices in proportion to
  `-ts`. The memory of each device is `memory.estimate(rpc_devices=…)`.
- The head keeps at least its first block (`-ngl` at most n_layer): with every layer offloaded llama.cpp turns on
  pipeline parallelism, whose copies of the graph are not modelled. It also keeps the token embeddings, the
  logits, the host extras and every mask (`compute.split_compute_buffers`).
- Only a node without GPUs is a head: a GPU head's host buffer type and its GPUs' share of the layers are not
  planned (they would change what the host repacks and where the output goes). A head must hold the cluster's
  certificates (its telemetry's `split`), which reach the members; a member must lend (`split.lend_host`:
  it runs `ggml-rpc-server` behind a tunnel exit), its host memory ("CPU") only.
- Layers are assigned in device order, each device taking as many of the next blocks as it holds: the head
  first, then the members, the one with the most memory available first (ties by node id). The member that
  takes the last block with tensors takes the output layer with it; a member holding only the output layer
  is never planned, and a member given no block is left out. `-ts` is each member's count of layers, which
  llama.cpp's float32 arithmetic turns back into exactly that assignment (checked with `layer_devices`).
  Each device's figure depends only on its own blocks, so taking the most each device holds finds a split
  whenever one exists in that device order.
- Among the heads whose split fits: the fewest members, then the most headroom on the tightest device of the
  split, then node ids in natural order. At most `MAX_HEADS` heads (the most host memory first) and
  `MAX_MEMBERS` members are considered, so the work stays bounded on a large fleet.
- The context: a given `ctx` is checked as is; without one, or with `max_ctx`, the largest a split holds, capped
  at the model's training context (and never below a given `ctx`).
Nothing here reads a clock, a file or the bus.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from actors.placement.memory import CELL_PAD, Budgets, MemoryModelError, estimate
from actors.placement.weights import layer_devices
from messages.memory import DeviceMemory, MemoryBreakdown
from messages.model import ModelGeometry
from messages.settings import ServingSettings
from messages.telemetry import NodeResources

__all__ = ["MAX_HEADS", "MAX_MEMBERS", "Lender", "SplitFit", "best_split", "lends", "node_share", "plan_split"]

#: The most nodes tried as the head of one split, and the most members one split may have.
MAX_HEADS = 8
MAX_MEMBERS = 8

_DIGITS = re.compile(r"(\d+)")


def _natural(text: str) -> tuple[tuple[int, int, str], ...]:
    return tuple((0, int(p), p) if p.isdigit() else (1, 0, p) for p in _DIGITS.split(text) if p)


@dataclass(frozen=True, slots=True)
class Lender:
    """A node that may take part in a split: its report and what its ledger says it has per device."""

    node: NodeResources
    have: Mapping[str, int]
    revision: int = 0  # its report's nodes-bucket revision (the decision records it)

    @property
    def host(self) -> int:
        return self.have.get("CPU", 0)


@dataclass(frozen=True, slots=True)
class SplitFit:
    """A split that fits: the head, its members in `--rpc` order, how llama-server runs it, and its breakdown
    (devices "CPU" for the head's host, "RPC<i>" for member i, each with its budget)."""

    head: Lender
    members: tuple[Lender, ...]
    settings: ServingSettings
    ctx: int
    ceiling: int | None
    n_gpu_layers: int
    tensor_split: tuple[float, ...]
    layers: tuple[tuple[int, int], ...]  # [first, last) blocks of the head, then of each member
    breakdown: MemoryBreakdown
    headroom: int  # the least any device of the split keeps free


def _step(settings: ServingSettings) -> int:
    return CELL_PAD if settings.kv_unified else CELL_PAD * settings.slots


class _Planner:
    """Plans the layers of one head and an ordered list of candidate members at a given context."""

    def __init__(
        self,
        geometry: ModelGeometry,
        settings: ServingSettings,
        head: Lender,
        members: Sequence[Lender],
    ) -> None:
        self.geometry = geometry
        self.settings = settings
        self.head = head
        self.members = members
        loaded = [layer.index for layer in geometry.layers if not layer.nextn]
        # the last block with tensors must go to a member with the output layer: none holds the output alone
        self.last_loaded = loaded[-1] if loaded else -1
        self.features = head.node.host.cpu_features

    def _estimate(self, ctx: int, counts: Sequence[int]) -> MemoryBreakdown:
        """The split whose devices hold `counts` layers each (the host first; the last also the output)."""
        n_all = self.geometry.n_layer + 1
        return estimate(
            self.geometry, self.settings, ctx, n_gpu_layers=n_all - counts[0],
            gpu_split=tuple(float(c) for c in counts[1:]), rpc_devices=len(counts) - 1, cpu_features=self.features,
        )  # fmt: skip

    def _device_fits(self, ctx: int, counts: Sequence[int], index: int, budget: int) -> bool:
        name = "CPU" if index == 0 else f"RPC{index - 1}"
        device = next((d for d in self._estimate(ctx, counts).devices if d.device == name), None)
        return device is None or device.total_bytes <= budget

    def _most(self, ctx: int, prefix: list[int], start: int, index: int, budget: int) -> int:
        """The most layers device `index` holds from layer `start` on (0: not even one block). Taking every
        layer left (the output with them) is tried first; otherwise it leaves a block with tensors to the next
        device, which holds the rest while this one is measured."""
        n_all = self.geometry.n_layer + 1
        left = n_all - start
        if index > 0 and self._device_fits(ctx, [*prefix, left], index, budget):
            return left
        lo, hi = 0, self.last_loaded - start  # at most this many, or nothing holds the last block but the output
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._device_fits(ctx, [*prefix, mid, left - mid], index, budget):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def plan(self, ctx: int) -> tuple[list[int], tuple[Lender, ...]] | None:
        """Layers per device (the head first) and the members used, or None when this order holds no split."""
        n_all = self.geometry.n_layer + 1
        head = self._most(ctx, [], 0, 0, self.head.host)
        if head == 0:
            return None
        counts, used = [head], []
        start = head
        for member in self.members:
            if start == n_all:
                break
            taken = self._most(ctx, counts, start, len(counts), member.host)
            if taken:
                counts.append(taken)
                used.append(member)
                start += taken
        if start != n_all:
            return None
        return counts, tuple(used)


def lends(node: NodeResources) -> bool:
    """Whether `node` lends its host memory to splits (its telemetry names where it lends)."""
    return node.split is not None and node.split.lend_host is not None and "CPU" in node.split.lend_devices


def plan_split(
    geometry: ModelGeometry,
    settings: ServingSettings,
    head: Lender,
    candidates: Iterable[Lender],
    *,
    ctx: int | None,
    max_ctx: bool,
) -> SplitFit | None:
    """The split with `head` over some of `candidates` (the largest first), or None when none fits.

    Raises `MemoryModelError` when the model and settings cannot be split at all (a draft, an MTP context, …)."""
    members = sorted(
        (c for c in candidates if c.node.node_id != head.node.node_id and c.host > 0 and lends(c.node)),
        key=lambda c: (-c.host, _natural(c.node.node_id)),
    )[:MAX_MEMBERS]
    if not members or geometry.n_layer < 2:
        return None
    planner = _Planner(geometry, settings, head, members)
    step = _step(settings)
    ceiling: int | None = None
    if ctx is not None and not max_ctx:
        chosen = ctx
    else:
        cap = (geometry.n_ctx_train // step) * step if geometry.n_ctx_train >= step else 1 << 24
        cap = max(cap, ctx or 0)
        ceiling = _largest(planner, step, cap)
        if ceiling is None:
            return None
        chosen = max(ceiling, ctx or 0)
    planned = planner.plan(chosen)
    if planned is None:
        return None
    counts, used = planned
    n_gpu_layers = geometry.n_layer + 1 - counts[0]
    tensor_split = tuple(float(c) for c in counts[1:])
    # integer weights give back exactly this assignment in llama.cpp's arithmetic: checked, never assumed
    devices = layer_devices(geometry, n_gpu_layers, tensor_split)
    bounds, first = [], 0
    for index, count in enumerate(counts):
        bounds.append((first, min(first + count, geometry.n_layer)))
        if any(devices[il] != index - 1 for il in range(first, first + count)):
            return None
        first += count
    budgets = Budgets(host=head.host, rpc=tuple(m.host for m in used))
    breakdown = estimate(
        geometry, settings, chosen, n_gpu_layers=n_gpu_layers, gpu_split=tensor_split, rpc_devices=len(used),
        budgets=budgets, cpu_features=head.node.host.cpu_features,
    )  # fmt: skip
    if not breakdown.fits:
        return None
    breakdown = msgspec.structs.replace(breakdown, max_context=ceiling)
    headroom = min((d.budget_bytes or 0) - d.total_bytes for d in breakdown.devices)
    return SplitFit(
        head=head,
        members=used,
        settings=settings,
        ctx=chosen,
        ceiling=ceiling,
        n_gpu_layers=n_gpu_layers,
        tensor_split=tensor_split,
        layers=tuple(bounds),
        breakdown=breakdown,
        headroom=headroom,
    )


def _largest(planner: _Planner, step: int, cap: int) -> int | None:
    """The largest context (a multiple of `step`, at most `cap`) the planner holds; doubling, then bisection."""
    limit = max(1, cap // step)
    if planner.plan(step) is None:
        return None
    lo, hi = 1, 2
    while hi <= limit and planner.plan(hi * step) is not None:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if planner.plan(mid * step) is not None:
            lo = mid
        else:
            hi = mid
    return lo * step


def best_split(
    geometry: ModelGeometry,
    settings_of: Mapping[str, ServingSettings],
    lenders: Sequence[Lender],
    *,
    ctx: int | None,
    max_ctx: bool,
) -> tuple[SplitFit | None, str]:
    """The best split over `lenders` (heads: those without GPUs, `settings_of` naming what each would run with),
    or None and why none was found."""
    heads = sorted(
        (
            lender
            for lender in lenders
            if not lender.node.gpus and lender.node.node_id in settings_of and lender.node.split is not None
        ),
        key=lambda lender: (-lender.host, _natural(lender.node.node_id)),
    )[:MAX_HEADS]
    if not heads:
        return None, "no eligible node without GPUs and with the cluster's certificates can head a split"
    if len(lenders) < 2:
        return None, "a split needs at least two eligible nodes"
    found: list[SplitFit] = []
    refused = ""
    for head in heads:
        try:
            fit = plan_split(geometry, settings_of[head.node.node_id], head, lenders, ctx=ctx, max_ctx=max_ctx)
        except MemoryModelError as exc:
            refused = str(exc)
            continue
        if fit is not None:
            found.append(fit)
    if not found:
        return None, refused or "no split over the eligible nodes holds the model"
    best = min(found, key=lambda f: (len(f.members), -f.headroom, _natural(f.head.node.node_id)))
    return best, ""


def node_share(breakdown: MemoryBreakdown, devices: Sequence[DeviceMemory]) -> MemoryBreakdown:
    """A node's part of a split's breakdown: its devices, and the totals of those devices (the cache figures
    that are not per device, K, V and SWA parts, stay the whole model's)."""

    def total(field: str) -> int:
        return sum(int(getattr(d, field)) for d in devices)

    return msgspec.structs.replace(
        breakdown,
        devices=tuple(devices),
        weights_bytes=total("weights_bytes"),
        kv_bytes=total("kv_bytes"),
        recurrent_bytes=total("recurrent_bytes"),
        repack_bytes=total("repack_bytes"),
        amx_bytes=total("amx_bytes"),
        compute_bytes=total("compute_bytes"),
        compute_margin_bytes=total("compute_margin_bytes"),
        output_bytes=total("output_bytes"),
        host_extra_bytes=total("host_extra_bytes"),
        total_bytes=total("total_bytes"),
        fits=all(d.fits is not False for d in devices),
    )
