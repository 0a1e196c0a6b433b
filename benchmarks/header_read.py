"""Benchmark: reading a GGUF header with a Qwen-size tokenizer, ours vs gguf.GGUFReader.

Generates (in a temporary directory) a GGUF file whose header holds a Qwen2-size BPE tokenizer (151,936
token strings, ~151k merges, scores and token types) plus a few hundred small tensors, then:

- times ``actors.placement.gguf_header.read_header`` and ``gguf.GGUFReader`` (median of several runs each,
  in this process, after one warm-up read so the file is in the page cache for both);
- measures the memory of one read of each in a fresh subprocess: the peak-RSS growth (``VmHWM``, or
  ``ru_maxrss`` where /proc is absent) over the subprocess's own baseline after imports, and the
  ``tracemalloc`` peak.

Prints the environment, the numbers and the ratios. Run from the repository root:

    python -m benchmarks.header_read [--runs 7] [--baseline-runs 3]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from actors.placement.gguf_header import read_header

N_VOCAB = 151_936  # Qwen2 / Qwen2.5 vocabulary
N_MERGES = 151_387
N_LAYERS = 28
TENSORS_PER_LAYER = 11


def _token(rng: random.Random, i: int) -> str:
    # Byte-level BPE tokens: mostly short ASCII pieces, often with the "Ġ" (space) marker, some multibyte.
    if i < 256:
        return f"<0x{i:02X}>"
    n = rng.choice((1, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 10, 12))
    piece = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzéüß中文") for _ in range(n))
    return ("Ġ" if rng.random() < 0.4 else "") + piece + f"{i}"


def generate(path: Path) -> None:
    rng = random.Random(0)
    tokens = [_token(rng, i) for i in range(N_VOCAB)]
    merges = [f"{tokens[rng.randrange(256, N_VOCAB)]} {tokens[rng.randrange(256, N_VOCAB)]}" for _ in range(N_MERGES)]
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(N_LAYERS)
    w.add_context_length(32_768)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_scores([-float(i) for i in range(N_VOCAB)])
    w.add_token_types([1] * N_VOCAB)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}" * 40)
    small = np.zeros((8, 64), dtype=np.float32)
    w.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float16))
    names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up")
    for layer in range(N_LAYERS):
        for j in range(TENSORS_PER_LAYER):
            suffix = names[j] if j < len(names) else f"extra{j}"
            w.add_tensor(f"blk.{layer}.{suffix}.weight", small)
    w.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    w.add_tensor("output.weight", np.zeros((64, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read_ours(path: str) -> int:
    return read_header(path).total_tensor_bytes


def _read_gguf(path: str) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


READERS: dict[str, Callable[[str], int]] = {"ours": _read_ours, "gguf": _read_gguf}


def _maxrss_bytes() -> int:
    # Linux carries ru_maxrss across execve, so a child started by a big parent would report the parent's
    # peak; the VmHWM of /proc is per address space and starts afresh in the child.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # KiB on Linux, bytes on macOS


def child(reader: str, path: str, mode: str) -> None:
    """Runs in a fresh interpreter: one read, reporting memory growth over the post-import baseline."""
    fn = READERS[reader]
    if mode == "rss":
        before = _maxrss_bytes()
        fn(path)
        print(json.dumps({"bytes": _maxrss_bytes() - before}))
    else:
        tracemalloc.start()
        fn(path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(json.dumps({"bytes": peak}))


def _in_subprocess(reader: str, path: Path, mode: str) -> int:
    cmd = [sys.executable, "-m", "benchmarks.header_read", "--child", reader, str(path), mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    result: int = json.loads(out.stdout.strip().splitlines()[-1])["bytes"]
    return result


def _median_seconds(fn: Callable[[str], int], path: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(str(path))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):8.2f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="timed reads with read_header (median reported)")
    ap.add_argument("--baseline-runs", type=int, default=3, help="timed reads with gguf.GGUFReader")
    ap.add_argument("--child", nargs=3, metavar=("READER", "PATH", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return

    versions = {p: importlib.metadata.version(p) for p in ("gguf", "numpy")}
    print("environment")
    print(f"  python    {platform.python_implementation()} {platform.python_version()}")
    print(f"  platform  {platform.platform()}")
    print(f"  cpus      {os.cpu_count()}")
    print("  packages  " + ", ".join(f"{k} {v}" for k, v in versions.items()))

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen-size-tokenizer.gguf"
        t0 = time.perf_counter()
        generate(path)
        header = read_header(path)
        print("input")
        print(f"  file      {path.stat().st_size:,} bytes, generated in {time.perf_counter() - t0:.1f} s")
        print(f"  header    {header.data_offset:,} bytes, {len(header.kv)} keys, {len(header.tensors)} tensors")
        print(f"  tokens    {header.get('tokenizer.ggml.tokens')}")
        print(f"  merges    {header.get('tokenizer.ggml.merges')}")

        # Both readers must agree on what they found, or the timing means nothing.
        ours_total, gguf_total = _read_ours(str(path)), _read_gguf(str(path))  # also warms the page cache
        assert ours_total == gguf_total, (ours_total, gguf_total)
        print(f"  agree     total tensor bytes {ours_total:,} from both readers")

        t_ours = _median_seconds(_read_ours, path, args.runs)
        t_gguf = _median_seconds(_read_gguf, path, args.baseline_runs)
        rss = {r: _in_subprocess(r, path, "rss") for r in READERS}
        peak = {r: _in_subprocess(r, path, "tracemalloc") for r in READERS}

    print(f"time (median; read_header x{args.runs}, GGUFReader x{args.baseline_runs})")
    print(f"  read_header       {t_ours * 1000:10.1f} ms")
    print(f"  gguf.GGUFReader   {t_gguf * 1000:10.1f} ms")
    print(f"  ratio             {t_gguf / t_ours:10.1f} x faster")
    print("memory of one read in a fresh process (peak RSS growth over post-import baseline; tracemalloc peak)")
    print(f"  read_header       rss {_mib(rss['ours'])}   peak {_mib(peak['ours'])}")
    print(f"  gguf.GGUFReader   rss {_mib(rss['gguf'])}   peak {_mib(peak['gguf'])}")
    if peak["ours"]:
        print(f"  ratio (peak)      {peak['gguf'] / peak['ours']:10.1f} x less")


if __name__ == "__main__":
    main()
