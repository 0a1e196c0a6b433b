"""The C allocator's policy for a node's process: buffers of a handoff's size are reused, not remapped.

A node moves KV state in chunks of about 1 MiB (NATS messages) and segments of 32 MiB. Every one of those
buffers is a fresh allocation inside nats-py and asyncio (a message's bytes, its publish command, the joined
write). glibc serves allocations past its mmap threshold with a new mapping and gives the top of its heap back
to the kernel past its trim threshold, so each buffer's pages are faulted in and zeroed again: measured, that
page-fault work cost a third of a handoff's throughput on two cores (benchmarks/RESULTS.md, "KV handoff
throughput"). Raising both thresholds keeps freed buffers in the heap for the next ones.

What it costs: the process keeps free memory in its heaps instead of returning it: at the top of the main heap
up to `TRIM_THRESHOLD`, and in the worker threads' heaps (64 MiB each at most) all of it. That is bounded by the
node's own high-water mark: its handoff windows, segments in flight, and the worker threads' buffers.

Only the process that owns its allocator applies it (`mesh-actor run`, and benchmarks standing in for nodes),
never a library import. Elsewhere than glibc it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

from runtime.logging import get_logger

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 64 << 20  # a 32 MiB segment and everything smaller comes from the heap
TRIM_THRESHOLD = 256 << 20  # free memory at the heap's top is kept up to this much


@dataclass(frozen=True, slots=True)
class AllocatorPolicy:
    applied: bool
    reason: str


def keep_large_buffers(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> AllocatorPolicy:
    """Sets glibc's mmap and trim thresholds for this process (see the module's docstring)."""
    log = get_logger(component="allocator")
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        policy = AllocatorPolicy(False, "not glibc: the allocator's defaults stay")
        log.info("allocator_policy", applied=False, reason=policy.reason)
        return policy
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    gnu_get_libc_version.restype = ctypes.c_char_p
    version = gnu_get_libc_version().decode()
    # mallopt answers 1 on success. Some glibc releases refuse an mmap threshold over 32 MiB (half their largest
    # heap): then 32 MiB, which still keeps every chunk-sized buffer in the heap. The trim threshold is set
    # either way (its call also turns off glibc's dynamic adjustment of both).
    mmap_set = next((v for v in (mmap_threshold, min(mmap_threshold, 32 << 20)) if mallopt(_M_MMAP_THRESHOLD, v)), None)
    trim_set = mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    applied = mmap_set is not None and trim_set
    mmap_text = f"{mmap_set >> 20} MiB" if mmap_set is not None else "refused"
    reason = f"glibc {version}: mmap threshold {mmap_text}, trim threshold "
    reason += f"{trim_threshold >> 20} MiB" if trim_set else "refused"
    log.info("allocator_policy", applied=applied, reason=reason)
    return AllocatorPolicy(applied, reason)
