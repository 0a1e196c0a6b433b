"""`mesh-actor generate MODEL PROMPT`: one generation through the mesh (`mesh.generate`).

Tokens are printed as they come with `--stream` (the default on a terminal); `--json` prints the whole reply
object instead (text, token ids, where the prefix came from, tokens restored and evaluated, timings, node and
instance, and the request's `trace`). `--tokens` reads PROMPT as comma-separated token ids. The request runs in a
new W3C trace, or the one `--traceparent` names: `mesh-actor events --trace ID` finds its events. Exit codes:
0 done, 1 the mesh refused or failed (the error code and message on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from messages.generate import GenerateChunk, GenerateRequest, GenerateResult
from messages.subjects import Subjects
from runtime import tracing
from runtime.bus import BusError, RemoteError
from runtime.cli.common import EXIT_OK, EXIT_USAGE, CliError, add_client_options, connect, emit_json, prefix
from runtime.generate_client import StreamGap, generate


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser("generate", help="generate text with a model served by the mesh")
    p.add_argument("model", metavar="MODEL", help="registry name, model path as placed, file name, or instance id")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text (with --tokens: comma-separated token ids)")
    p.add_argument("-n", "--n-predict", type=int, default=128, metavar="N", help="tokens to generate (128)")
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--tokens", action="store_true", help="PROMPT is token ids, e.g. 1,15,27")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at TEXT (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="the whole generation (300 s)")
    p.add_argument("--no-capture", action="store_true", help="do not keep this prompt's state in L3")
    p.add_argument(
        "--prefill-node", metavar="NODE", help="prefill on NODE, hand the state off, decode on the routed instance"
    )
    p.add_argument(
        "--traceparent", metavar="TRACEPARENT", type=_traceparent,
        help="run the request in this W3C trace (default: a new one; its id is printed, and `trace` in --json)",
    )  # fmt: skip
    add_client_options(p)
    p.set_defaults(func=cmd_generate)


def _traceparent(text: str) -> tracing.TraceContext:
    ctx = tracing.parse(text.strip())
    if ctx is None:
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
    return ctx


def _request(args: argparse.Namespace) -> GenerateRequest:
    prompt: str | list[int] = args.prompt
    if args.tokens:
        try:
            prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
        except ValueError as exc:
            raise CliError(f"--tokens: {args.prompt[:80]!r} is not comma-separated token ids", EXIT_USAGE) from exc
    fields = {
        "model": args.model,
        "prompt": prompt,
        "n_predict": args.n_predict,
        "timeout_s": args.timeout,
        "capture": not args.no_capture,
        "prefill_node": args.prefill_node,
        "sampling": {
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "min_p": args.min_p,
            "seed": args.seed,
            "stop": args.stop,
        },
    }
    try:
        return msgspec.convert(fields, GenerateRequest)
    except msgspec.ValidationError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc


async def run_generate(
    args: argparse.Namespace, show: Callable[[GenerateChunk], Awaitable[None]] | None = None
) -> tuple[GenerateResult, tracing.TraceContext]:
    """The generation `generate` asks for (`show`: each chunk as it streams), and the client's trace context."""
    request = _request(args)
    bus = await connect(args, "generate")
    # the client's own span: the router's hop is its child, and every event of the request carries its trace id
    trace = args.traceparent or tracing.child(tracing.fresh())
    try:
        with tracing.use(trace):
            return await generate(bus, Subjects(prefix(args)), request, show), trace
    except RemoteError as exc:
        raise CliError(f"{exc.code}: {exc.reply.message}") from exc
    except (BusError, StreamGap) as exc:
        raise CliError(str(exc)) from exc
    finally:
        await bus.close()


def generate_record(result: GenerateResult, trace: tracing.TraceContext) -> dict[str, Any]:
    """What `generate --json` prints."""
    return {**msgspec.to_builtins(result), "trace": trace.traceparent}


async def cmd_generate(args: argparse.Namespace) -> int:
    stream = args.stream and not args.json

    async def show(chunk: GenerateChunk) -> None:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()

    result, trace = await run_generate(args, show if stream else None)
    if args.json:
        emit_json(generate_record(result, trace))
        return EXIT_OK
    if stream:
        sys.stdout.write("\n")
    else:
        sys.stdout.write(result.text + "\n")
    print(
        f"[{result.node}/{result.instance} slot {result.slot}: {result.prompt_tokens} prompt tokens, "
        f"{result.tokens_restored} restored ({result.source}), {result.tokens_evaluated} evaluated, "
        f"{len(result.tokens)} generated, first token {result.ttft_ms:.0f} ms, total {result.total_ms:.0f} ms"
        + (
            f"; prefilled on {result.prefill_node}, {result.handoff_bytes} bytes handed off in "
            f"{result.handoff_ms:.0f} ms]"
            if result.path == "disaggregated"
            else "]"
        )
        + f" trace {trace.trace_hex}",
        file=sys.stderr,
    )
    return EXIT_OK
