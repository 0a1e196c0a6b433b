"""Benchmark: time to first token, local vs disaggregated, over prompt lengths around the predicted break-even.

Two `mesh-actor run` nodes on one machine, a sparse 0.5B-parameter model (real compute cost) on each:
`slow` runs llama-server on 1 thread, `fast` on 2 (both cores), so `fast` prefills about twice as fast. Every
request decodes on `slow`'s instance (named by its instance id) and is either local (`prefill_node` = `slow`:
the whole prompt computed there) or disaggregated (`prefill_node` = `fast`: all but the last token computed
on `fast`, the state handed off into `slow`'s store and restored there). Each prompt is new (random ids), so
nothing is reused; time to first token is the whole request with `n_predict` 1, timed at the client.

The prediction is the router's own cost model (`actors.handoff.cost.breakeven`), fed what this run measured:
each instance's prefill tokens/s and state size from its serving report (llama-server's timings, smoothed),
and the link fitted (`cost.fit_link`) on the disaggregated replies' `handoff_bytes` and `handoff_ms`. The
measured crossover is where least-squares lines through each path's times cross (and, for reference, the
first swept length at which the disaggregated median is lower). Run from the repository root:

    python -m benchmarks.handoff_crossover [--lengths 8,16,...] [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.handoff import cost
from benchmarks.environment import print_environment
from benchmarks.mesh_node import cli, connect, print_provenance, start_model, write_model
from messages.generate import GenerateRequest, GenerateResult, InstanceLoad, Sampling, ServingReport
from messages.subjects import Subjects
from runtime.bus import Bus, decode_checked
from runtime.generate_client import generate
from tests.conftest import node_process

FLAGS = ("--parallel", "1", "--cache-ram", "0", "--ctx-checkpoints", "0")
CTX = 4096


async def _ask(bus: Bus, instance: str, prompt: list[int], prefill_node: str) -> tuple[float, GenerateResult]:
    request = GenerateRequest(
        model=instance, prompt=prompt, n_predict=1, sampling=Sampling(temperature=0), timeout_s=600,
        capture=False, prefill_node=prefill_node,
    )  # fmt: skip
    started = time.perf_counter()
    result = await generate(bus, Subjects(), request)
    return time.perf_counter() - started, result


async def _loads(bus: Bus, instances: set[str], timeout: float = 20) -> dict[str, InstanceLoad]:
    """The latest serving-report line of each instance (reports come every few seconds and on change)."""
    found: dict[str, InstanceLoad] = {}
    sub = await bus.nc.subscribe(Subjects().serving_all)
    try:
        async with asyncio.timeout(timeout):
            async for msg in sub.messages:
                report = decode_checked(msg.data, ServingReport, "serving report")
                found.update({i.instance_id: i for i in report.instances if i.instance_id in instances})
                if set(found) == instances and all(found[i].prefill_tokens_per_s > 0 for i in instances):
                    return found
    finally:
        await sub.unsubscribe()
    return found


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (n, seconds)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


async def main_async(args: argparse.Namespace) -> None:
    print_environment()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(20261201)
    with tempfile.TemporaryDirectory(prefix="handoff-crossover-", dir=args.dir) as tmp:
        root = Path(tmp)
        model = write_model(Path(args.dir or tempfile.gettempdir()) / "mesh-bench-0.5b.gguf")
        print_provenance(model)
        slow_dir, fast_dir = root / "slow", root / "fast"
        async with node_process(slow_dir, "slow", *FLAGS, "--threads", "1", ready_s=60):
            env = await cli("nats-env", "--json", "--data-dir", str(slow_dir))
            join = {
                "MESH_ACTOR_NATS": env["url"], "MESH_ACTOR_NATS_USER": env["user"],
                "MESH_ACTOR_NATS_PASSWORD": env["password"],
            }  # fmt: skip
            async with node_process(fast_dir, "fast", *FLAGS, "--threads", "2", env=join, ready_s=60):
                slow_id = (await start_model(slow_dir, model, CTX, "slow"))["id"]
                fast_id = (await start_model(slow_dir, model, CTX, "fast"))["id"]
                bus = await connect(slow_dir)
                try:
                    for n in (256, 256, 128):  # warm both servers and their measured prefill rates
                        await _ask(bus, slow_id, [rng.randrange(3, 32000) for _ in range(n)], "slow")
                        await _ask(bus, slow_id, [rng.randrange(3, 32000) for _ in range(n)], "fast")
                    times: dict[str, dict[int, list[float]]] = {"local": {}, "disaggregated": {}}
                    handoffs: list[tuple[float, float]] = []
                    for _ in range(args.rounds):  # interleaved, so drift in the machine's load spreads over all
                        for n in lengths:
                            for path, where in (("local", "slow"), ("disaggregated", "fast")):
                                prompt = [rng.randrange(3, 32000) for _ in range(n)]
                                seconds, result = await _ask(bus, slow_id, prompt, where)
                                assert result.path == path, (path, result.path)
                                times[path].setdefault(n, []).append(seconds)
                                if path == "disaggregated":
                                    handoffs.append((result.handoff_bytes, result.handoff_ms / 1000))
                    loads = await _loads(bus, {slow_id, fast_id})
                finally:
                    await bus.close()

    slow, fast = loads[slow_id], loads[fast_id]
    link = cost.fit_link(handoffs)
    assert link is not None
    size = cost.StateSize(bytes_per_token=slow.state_bytes_per_token, floor_bytes=slow.state_floor_bytes)
    rates = cost.Rates(
        local_tokens_per_s=slow.prefill_tokens_per_s,
        remote_tokens_per_s=fast.prefill_tokens_per_s,
        link_bytes_per_s=link.bytes_per_s,
        fixed_s=link.fixed_s,
    )
    be = cost.breakeven(size, rates)  # tokens computed remotely; the prompt has one more
    predicted = None if be is None else be + 1
    print(f"  threads          slow 1, fast 2; {args.rounds} rounds; n_predict 1; ctx {CTX}")
    print(
        f"measured rates: prefill slow {slow.prefill_tokens_per_s:.1f} tok/s, fast {fast.prefill_tokens_per_s:.1f}"
        f" tok/s; state {slow.state_bytes_per_token:.0f} B/token + {slow.state_floor_bytes:.0f} B;"
        f" handoff {link.bytes_per_s / 2**20:.1f} MiB/s + {link.fixed_s * 1000:.1f} ms"
    )
    print(f"{'prompt':>7} {'local ms (median)':>18} {'disaggregated ms':>17} {'faster':>14}")
    first_win = None
    for n in lengths:
        local, remote = statistics.median(times["local"][n]), statistics.median(times["disaggregated"][n])
        winner = "disaggregated" if remote < local else "local"
        if winner == "disaggregated" and first_win is None:
            first_win = n
        print(f"{n:7d} {local * 1000:18.1f} {remote * 1000:17.1f} {winner:>14}")
    a_l, b_l = _line([(n, t) for n, ts in times["local"].items() for t in ts])
    a_r, b_r = _line([(n, t) for n, ts in times["disaggregated"].items() for t in ts])
    crossing = (a_r - a_l) / (b_l - b_r) if b_l > b_r else None
    print(f"local line        {a_l * 1000:8.1f} ms + {b_l * 1000:.2f} ms/token")
    print(f"disaggregated     {a_r * 1000:8.1f} ms + {b_r * 1000:.2f} ms/token")
    print(f"predicted break-even  {predicted} prompt tokens (cost model, this run's rates and link)")
    print(f"measured crossover    {'none' if crossing is None else f'{crossing:.1f}'} prompt tokens (lines cross);")
    print(f"                      first swept length won by the handoff: {first_win}")
    if crossing is not None and predicted is not None:
        error = abs(crossing - predicted) / predicted
        print(f"error {100 * error:.1f}% (target <= 25%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8,16,24,32,48,64,96,128,192,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the model and data dirs go (default: the system temp dir)")
    args: Any = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
