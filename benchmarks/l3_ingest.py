"""Benchmark: L3 ingest vs `cp`, and assemble/verify vs blake3 of the file (b3sum), same run, same file.

Writes a file of random bytes (1 GiB by default; random, so no segment deduplicates) in a temporary
directory on the file system that holds `--dir`, warms the page cache with one read, then, in interleaved
rounds:

- `cp` of the file (the baseline the issue names) and `cp` followed by an fsync of the copy (what a durable
  copy costs);
- `Store.ingest` at several segment sizes (a fresh store each time): the entry is loadable when it returns
  (compare with `cp`, whose copy is in the page cache too), then `Store.flush`, which makes it durable
  (fsyncs every segment and directory: compare "ingest + flush" with `cp` + fsync);
- blake3 of the whole file with the blake3 package, memory-mapped and multi-threaded (what `b3sum` does),
  and, for reference, of the `cp` copy (pages written by a kernel copy hash back slower than pages written
  by large writes, so the same bytes hash at different speeds);
- `Store.verify` (every segment and the payload re-hashed, nothing written) and `Store.assemble` (the same,
  writing the payload to a file, as a restore does).

Prints the environment, the median and best times and the ratios. The file system here is mounted with
`discard`, so deleting a previous run's gigabytes can slow the next operation: every operation is repeated,
interleaved, and both the median and the best round are shown. Run from the repository root:

    python -m benchmarks.l3_ingest [--size-mib 1024] [--rounds 5] [--segments-mib 8,16,32,64] [--dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import blake3
import structlog

from actors.l3 import layout
from actors.l3.layout import Manifest
from actors.l3.store import Store
from benchmarks.transfer import write_random

MIB = 1024 * 1024
IDENTITY = "1d" * 32


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _filesystem(path: Path) -> str:
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, timeout=10, check=False)
    lines = out.stdout.strip().splitlines()
    return " ".join(lines[-1].split()[:2]) if len(lines) > 1 else "unknown"


def _timed(fn: Callable[[], object]) -> float:
    os.sync()  # untimed: no earlier operation's dirty pages are written back during this one
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _cp(src: Path, dst: Path) -> None:
    subprocess.run(["cp", str(src), str(dst)], check=True, timeout=600)


def _cp_fsync(src: Path, dst: Path) -> None:
    _cp(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _b3sum(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(str(path))
    return str(hasher.hexdigest())


def _two_pass(store: Store, manifest: Manifest) -> None:
    flat = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for seg in manifest.segments:
        path = str(store.segment_file(seg.digest))
        assert blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest() == seg.digest
        flat.update_mmap(path)
    flat.hexdigest()


def _drop(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()  # let the previous run's dirty pages reach the disk before the next one is timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--segments-mib", default="8,16,32,64", help="segment sizes to compare, MiB, comma-separated")
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (default: the system temp dir)")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    size = args.size_mib * MIB
    segment_sizes = [int(s) * MIB for s in args.segments_mib.split(",")]

    with tempfile.TemporaryDirectory(prefix="l3-bench-", dir=args.dir) as tmp:
        work = Path(tmp)
        print("environment")
        print(f"  python    {platform.python_implementation()} {platform.python_version()}")
        print(f"  platform  {platform.platform()}")
        print(f"  cpus      {os.cpu_count()}")
        print("  load      " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)")
        print(f"  fs        {_filesystem(work)} ({work.parent})")
        print(f"  packages  blake3 {_version('blake3')}, msgspec {_version('msgspec')}")
        print(f"  payload   {args.size_mib} MiB random, {args.rounds} rounds, page cache warm")

        source = work / "slot.bin"
        write_random(source, size)
        expected = _b3sum(source)  # also warms the page cache
        os.sync()

        times: dict[str, list[float]] = {}

        def record(name: str, seconds: float) -> None:
            times.setdefault(name, []).append(seconds)

        def ingest(store: Store) -> Manifest:
            return store.ingest(source, identity=IDENTITY, tokens=(1,), payload_kind="llama_slot")

        for round_no in range(args.rounds):
            _drop(work / "copy.bin")
            record("cp", _timed(lambda: _cp(source, work / "copy.bin")))
            _drop(work / "copy.bin")
            record("cp + fsync", _timed(lambda: _cp_fsync(source, work / "copy.bin")))
            record("b3sum of the cp copy (ref.)", _timed(lambda: _b3sum(work / "copy.bin")))
            _drop(work / "copy.bin")
            # Rotated each round: whatever runs first after the copies are deleted is slower here (the disk's
            # discards), and that must not fall on one segment size.
            k = round_no % len(segment_sizes)
            for seg in segment_sizes[k:] + segment_sizes[:k]:
                root = work / f"store-{seg // MIB}"
                _drop(root)
                store = Store(root, segment_bytes=seg)
                loadable = _timed(partial(ingest, store))
                flush_started = time.perf_counter()  # at once: a sync first would do the flush's work
                store.flush()
                record(f"ingest, {seg // MIB} MiB segments", loadable)
                record(f"ingest + flush, {seg // MIB} MiB", loadable + time.perf_counter() - flush_started)
                _drop(root)
            store = Store(work / "store-default")
            manifest = ingest(store)
            store.flush()
            store.verify(manifest)  # untimed: the store's pages warm, like the source's for b3sum
            record("b3sum (blake3 mmap)", _timed(lambda: _b3sum(source)))
            record("verify", _timed(partial(store.verify, manifest)))
            record("two-pass verify (ref.)", _timed(partial(_two_pass, store, manifest)))
            _drop(work / "out.bin")
            record("assemble", _timed(partial(store.assemble, manifest, work / "out.bin")))
            assert _b3sum(work / "out.bin") == expected
            _drop(work / "out.bin")
            _drop(work / "store-default")

        gib = size / (1024 * MIB)
        median = {name: statistics.median(values) for name, values in times.items()}
        best = {name: min(values) for name, values in times.items()}
        print()
        print("ratios are throughput ratios (baseline time / time), of the medians and of the best rounds")
        header = f"{'operation':<30} {'median s':>9} {'best s':>7} {'GiB/s':>6}"
        print(header + f" {'x cp':>11} {'x cp+fsync':>11} {'x b3sum':>11}")
        for name in times:
            cells = [f"{name:<30}", f"{median[name]:9.3f}", f"{best[name]:7.3f}", f"{gib / median[name]:6.2f}"]
            for base in ("cp", "cp + fsync", "b3sum (blake3 mmap)"):
                cells.append(f"{median[base] / median[name]:5.2f}/{best[base] / best[name]:5.2f}")
            print(" ".join(cells))
        print()
        print("rounds, s: " + "; ".join(f"{n}: " + " ".join(f"{v:.3f}" for v in vs) for n, vs in times.items()))
        print()
        print(f"default segment size: {layout.DEFAULT_SEGMENT_BYTES // MIB} MiB")


if __name__ == "__main__":
    main()
