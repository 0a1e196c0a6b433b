"""A generated doc's command line (`python -m docs.generate_<name> [--check]`): write the file when the code
renders it differently, or, with `--check`, exit 1 when the committed file is out of date."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def write_or_check(path: Path, render: Callable[[], str], command: str, argv: Sequence[str] | None) -> int:
    name = f"docs/{path.name}"
    parser = argparse.ArgumentParser(prog=command, description=f"Regenerate {name} from the code.")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {name} is out of date")
    args = parser.parse_args(argv)
    text = render()
    current = path.read_text(encoding="utf-8") if path.exists() else None
    if args.check:
        if current != text:
            sys.stderr.write(f"{name} is out of date: run `{command}`\n")
            return 1
        return 0
    if current != text:
        path.write_text(text, encoding="utf-8")
        sys.stdout.write(f"wrote {name}\n")
    else:
        sys.stdout.write(f"{name} is up to date\n")
    return 0
