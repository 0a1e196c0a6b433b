"""The `mesh-actor` command line: one module per family of subcommands, each with `register(subparsers)`.

Every subcommand handler takes the parsed arguments and returns the process exit code. Handlers may be
coroutine functions; `main` runs them with `asyncio.run`.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from collections.abc import Sequence

from runtime.cli import model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh-actor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in (model,):
        family.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.func
    try:
        code = asyncio.run(handler(args)) if inspect.iscoroutinefunction(handler) else handler(args)
    except KeyboardInterrupt:
        return 130
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
