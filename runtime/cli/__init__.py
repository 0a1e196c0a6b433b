"""The `mesh-actor` command line: one module per family of subcommands, each with `register(subparsers)`.

Every subcommand handler takes the parsed arguments and returns the process exit code (0 success,
1 failure, 2 usage or configuration error, 130 interrupted). Handlers may be coroutine functions. Errors
are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from collections.abc import Sequence

from runtime.cli import (
    creds,
    generate,
    handoff,
    journal,
    keys,
    l3,
    model,
    models,
    node,
    placement,
    replay,
    runner,
    usage,
)  # fmt: skip
from runtime.cli.common import CliError, OneLineParser
from runtime.logging import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mesh-actor", description="Control plane for llama-server nodes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    for family in (node, placement, replay, runner, journal, model, l3, generate, handoff, creds, models, keys, usage):
        family.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("warning")  # client commands: only problems, on stderr; `run` sets its own level
    handler = args.func
    try:
        code = asyncio.run(handler(args)) if inspect.iscoroutinefunction(handler) else handler(args)
    except CliError as exc:
        print(f"mesh-actor {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except TimeoutError:
        print(f"mesh-actor {args.command}: error: timed out", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
