"""ggml-alloc's placement of a graph's tensors, replayed (placement core).

llama.cpp sizes a compute buffer by allocating a worst-case graph once (`ggml_gallocr_alloc_graph_impl`): the
graph's inputs first, then each node in order, in place over a source it alone consumes where the op allows
(`ggml_op_can_inplace`, same layout: never over a strided view), otherwise in the best-fitting free block or on
top; every tensor is freed once its last consumer ran (a view keeps its source alive), outputs never. The
buffer is the highest address reached. A graph here is a list of `_Node`s named by what the llama.cpp graph
builds, so a model whose peak depends on where freed blocks are reused (`compute`'s node-by-node graphs, the
projector's image graph) gets ggml-alloc's own answer rather than a sum of rows.
"""

from __future__ import annotations

__all__ = ["GGML_ALIGNMENT", "INPLACE_OPS", "VIEW_OPS", "_Node", "_graph_peak"]

GGML_ALIGNMENT = 32  # the CPU buffer type's alignment, to which ggml-alloc rounds every tensor
#: Ops ggml-alloc may compute in place over a source (`ggml_op_can_inplace`), as named in `_graph_peak`.
INPLACE_OPS = frozenset({"add", "mul", "rms_norm", "rope", "unary", "scale", "soft_max", "sqr"})
#: Views of their first source: "view" (offset 0, the source's layout: an in-place op may take its source's
#: block) and "strided_view" (a slice whose layout differs from a contiguous result: never reused in place).
VIEW_OPS = frozenset({"view", "strided_view"})


class _Arena:
    """ggml-alloc's dynamic allocator (`ggml_dyn_tallocr`): best fit among the inner free blocks, else the
    tail block (which grows the buffer); freed blocks merge with their neighbours. `peak` is the buffer size."""

    def __init__(self) -> None:
        self.free: list[list[int]] = [[0, 1 << 62]]  # [offset, size], by offset; the last one is the tail
        self.peak = 0

    def alloc(self, size: int) -> int:
        size = -(-size // GGML_ALIGNMENT) * GGML_ALIGNMENT
        best = len(self.free) - 1
        best_size: int | None = None
        for i, (_, block) in enumerate(self.free[:-1]):
            if block >= size and (best_size is None or block <= best_size):
                best, best_size = i, block
        offset = self.free[best][0]
        self.free[best] = [offset + size, self.free[best][1] - size]
        if self.free[best][1] == 0:
            del self.free[best]
        self.peak = max(self.peak, offset + size)
        return offset

    def release(self, offset: int, size: int) -> None:
        size = -(-size // GGML_ALIGNMENT) * GGML_ALIGNMENT
        blocks = self.free
        for i, (start, block) in enumerate(blocks):
            if start + block == offset:
                blocks[i][1] += size
                if i + 1 < len(blocks) and offset + size == blocks[i + 1][0]:
                    blocks[i][1] += blocks.pop(i + 1)[1]
                return
            if offset + size == start:
                blocks[i] = [offset, block + size]
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == offset:
                    blocks[i - 1][1] += blocks.pop(i)[1]
                return
        blocks.insert(sum(1 for start, _ in blocks if start < offset), [offset, size])


#: (name, op, bytes, sources) of one graph node; a view op (`VIEW_OPS`) for a view of its first source,
#: "external" for a node whose result lies outside the buffer (a write into a cache)
_Node = tuple[str, str, int, tuple[str, ...]]


def _reusable_source(
    op: str,
    n_bytes: int,
    srcs: tuple[str, ...],
    offset: dict[str, int],
    size: dict[str, int],
    view_of: dict[str, str],
    children: dict[str, int],
    views: dict[str, int],
    outputs: frozenset[str],
    strided: frozenset[str] = frozenset(),
) -> str | None:
    """The tensor whose block an in-place op takes over (`ggml_gallocr_allocate_node`): a source no other
    node still reads and no view holds, of the same size, or the source of such a view if that view is its
    only one and has its layout (not in `strided`); not an output, nor a tensor ggml-alloc did not place."""
    if op not in INPLACE_OPS:
        return None
    for src in srcs:
        if src in strided:
            continue
        base = view_of.get(src, src)
        if base in outputs or base not in offset or children[src] != 1 or views.get(src, 0):
            continue
        if base != src and views[base] == 1 and not children.get(base, 0):
            return base
        if base == src and size[src] == n_bytes:
            return src
    return None


def _graph_peak(inputs: list[tuple[str, int]], nodes: list[_Node], outputs: frozenset[str]) -> int:
    """The buffer ggml-alloc reserves for a graph (`ggml_gallocr_alloc_graph_impl`): inputs first, then each
    node in order, in place over a source it alone consumes where the op allows, every tensor freed once its
    last consumer ran (a view keeps its source alive); outputs are never freed."""
    arena = _Arena()
    offset: dict[str, int] = {}
    size = dict(inputs) | {name: n_bytes for name, _, n_bytes, _ in nodes}
    view_of = {name: srcs[0] for name, op, _, srcs in nodes if op in VIEW_OPS}
    strided = frozenset(name for name, op, _, _ in nodes if op == "strided_view")
    children: dict[str, int] = {}
    views: dict[str, int] = {}
    for name, n_bytes in inputs:
        offset[name] = arena.alloc(n_bytes)
    for _, _, _, srcs in nodes:
        for src in srcs:
            children[src] = children.get(src, 0) + 1
    for src in view_of.values():
        views[src] = views.get(src, 0) + 1
    for name, op, n_bytes, srcs in nodes:
        if op in VIEW_OPS or op == "external":
            pass
        elif (
            reused := _reusable_source(op, n_bytes, srcs, offset, size, view_of, children, views, outputs, strided)
        ) is not None:
            offset[name] = offset.pop(reused)  # in place: the source's block, its tail freed if larger
            if size[reused] > n_bytes:
                arena.release(offset[name] + n_bytes, size[reused] - n_bytes)
        else:
            offset[name] = arena.alloc(n_bytes)
        for src in srcs:
            children[src] -= 1
            if children[src] or views.get(src, 0):
                continue
            base = view_of.get(src, src)
            if base != src:
                views[base] -= 1
                if views[base] or children.get(base, 0):
                    continue
            if base in offset and base not in outputs:
                arena.release(offset.pop(base), size[base])
    return arena.peak
