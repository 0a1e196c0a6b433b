"""The `mesh-actor` command line: one module per family of subcommands, each with `register(subparsers)`.

Every subcommand handler takes the parsed arguments and returns the process exit code (0 success,
1 failure, 2 usage or configuration error, 130 interrupted). Handlers may be coroutine functions. Errors
are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import sys
from collections.abc import Sequence

from runtime.cli.common import CliError, OneLineParser
from runtime.logging import configure_logging

#: The family that registers each top-level command. A command imports only its own family (the families'
#: imports are about two fifths of a call's start, and schedulers and scripts call `status` in loops); help and
#: a command no family names build the whole parser. A test checks this table against the whole parser.
FAMILY_OF = {
    "run": "node", "status": "node", "nats-env": "node", "place": "placement", "registry": "placement",
    "replay": "replay", "stop": "runner", "doctor": "runner", "events": "journal", "inspect": "model",
    "fit": "model", "l3": "l3", "generate": "generate", "handoff": "handoff", "creds": "creds", "models": "models",
    "keys": "keys", "usage": "usage",
}  # fmt: skip

#: The families in the order `--help` lists their commands (the table's order).
FAMILIES = tuple(dict.fromkeys(FAMILY_OF.values()))


def build_parser(families: Sequence[str] = FAMILIES) -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mesh-actor", description="Control plane for llama-server nodes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    for family in families:
        importlib.import_module(f"runtime.cli.{family}").register(sub)
    return parser


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the command `argv` names (its family's alone), or the whole one."""
    family = FAMILY_OF.get(argv[0]) if argv else None
    return build_parser((family,) if family is not None else FAMILIES)


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    args = parser_for(given).parse_args(given)
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
