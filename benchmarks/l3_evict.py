"""Benchmark: one L3 eviction pass, as the L3 actor runs it, on a store of many long-prompt entries.

Builds a store of `--entries` entries, each holding `--tokens` token ids (so each manifest lists that many
ids: what makes a manifest large) and a small random payload, then times, in interleaved rounds:

- **pass, nothing to evict**: what follows every capture when the store fits (`EntryIndex.plan` + `apply`);
- **pass, one entry evicted**: the same with a budget one byte short, so the least recently used entry goes:
  the decision, then `Store.apply_eviction` deleting its manifest and segments (the keeper's lock is held for
  both); the evicted entry is ingested again, untimed, for the next round;
- **reconcile**: what a start (or `mesh-actor l3 gc`) does once, re-reading every manifest to fill the entry_index.

Before this change (base commit 5eb2da8), every pass re-read and parsed every manifest in a worker thread
while holding the store's lock (`Store.enforce_budget`); the figures of that code are in
benchmarks/RESULTS.md beside these. Run from the repository root:

    python -m benchmarks.l3_evict [--entries 300] [--tokens 32768] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from actors.l3 import layout
from actors.l3.entry_index import EntryIndex
from actors.l3.store import Inventory, Store

IDENTITY = "1d" * 32
PAYLOAD = layout.MIN_SEGMENT_BYTES


def _entry_index(inventory: Inventory) -> EntryIndex:
    """The entry index as the keeper fills it from a reconcile pass (`keeper.StoreKeeper.refill`)."""
    entry_index = EntryIndex()
    for e in inventory.entries:
        entry_index.add(
            e.entry, identity=e.identity, n_tokens=e.n_tokens, bytes=e.bytes, last_use=e.mtime_ns / 1e9,
            segments=e.segments,
        )  # fmt: skip
    entry_index.set_segments(inventory.segment_bytes)
    return entry_index


def _tokens(i: int, n: int) -> list[int]:
    return [i, *range(n - 1)]


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the store goes (default: a temp dir)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        store = Store(root / "l3", segment_bytes=layout.MIN_SEGMENT_BYTES)
        rng = random.Random(1)
        source = root / "slot.bin"
        payloads: dict[str, bytes] = {}
        for i in range(args.entries):
            data = rng.randbytes(PAYLOAD)
            source.write_bytes(data)
            m = store.ingest(source, identity=IDENTITY, tokens=_tokens(i, args.tokens), payload_kind="llama_slot")
            payloads[layout.entry_id(m.identity, m.tokens)] = data
        store.flush()
        manifests = sum(p.stat().st_size for p in (root / "l3" / layout.MANIFESTS_DIR).iterdir())
        print("environment")
        print(f"  python    {platform.python_implementation()} {platform.python_version()}")
        print(f"  cpus      {os.cpu_count()}")
        print("  load      " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)")
        print(f"  store     {args.entries} entries of {args.tokens} tokens, {PAYLOAD} bytes each")
        print(f"            manifests {manifests / 2**20:.1f} MiB in all")

        fits, evict_one, reconcile = [], [], []
        entry_index = _entry_index(store.reconcile())
        total = entry_index.stored_bytes
        clock = time.time()
        evicted: list[str] = []

        def one() -> None:
            plan = entry_index.plan(total - 1)
            entry_index.apply(plan)
            store.apply_eviction(plan.evict, plan.free)
            assert len(plan.evict) == 1
            evicted.append(plan.evict[0])

        for _ in range(args.rounds):
            reconcile.append(_timed(lambda: _entry_index(store.reconcile())))
            fits.append(_timed(lambda: entry_index.apply(entry_index.plan(total))))
            evict_one.append(_timed(one))
            entry = evicted[-1]  # put it back, untimed, as the most recent use
            index = next(i for i in range(args.entries) if layout.entry_id(IDENTITY, _tokens(i, args.tokens)) == entry)
            source.write_bytes(payloads[entry])
            m = store.ingest(source, identity=IDENTITY, tokens=_tokens(index, args.tokens), payload_kind="llama_slot")
            store.flush()
            clock += 1
            segments = [(s.digest, s.length) for s in m.segments]
            entry_index.add(entry, identity=IDENTITY, n_tokens=m.n_tokens, bytes=m.total_bytes, last_use=clock,
                        segments=segments)  # fmt: skip

        def row(name: str, xs: list[float]) -> None:
            print(f"  {name:<34} median {statistics.median(xs) * 1000:9.3f} ms   best {min(xs) * 1000:9.3f} ms")

        print(f"results ({args.rounds} rounds)")
        row("pass, nothing to evict", fits)
        row("pass, one entry evicted", evict_one)
        row("reconcile (start, gc)", reconcile)


if __name__ == "__main__":
    main()
