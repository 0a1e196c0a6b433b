"""The command line builds only the family of the command it runs: its table of which family registers which
command is the whole parser's, and a command parsed by its family alone reads as by the whole parser."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from runtime.cli import FAMILY_OF, build_parser, parser_for


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_table_names_each_command_of_the_whole_parser_and_the_family_that_registers_it() -> None:
    whole = _commands(build_parser())
    assert set(FAMILY_OF) == set(whole)
    for command, family in FAMILY_OF.items():
        assert command in _commands(build_parser((family,))), (command, family)


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--json", "--data-dir", "d"],
        ["place", "m.gguf", "-c", "2048", "--node", "n1", "--json"],
        ["keys", "issue", "--tenant", "acme", "--rpm", "5"],
        ["l3", "ls", "--json"],
        ["fit", "m.gguf", "--ctx", "4096"],
        ["replay", "--json"],
    ],
)
def test_a_command_parsed_by_its_family_alone_reads_as_by_the_whole_parser(argv: list[str]) -> None:
    whole = vars(build_parser().parse_args(argv))
    alone = vars(parser_for(argv).parse_args(argv))
    assert {k: v for k, v in alone.items() if k != "func"} == {k: v for k, v in whole.items() if k != "func"}
    assert alone["func"].__qualname__ == whole["func"].__qualname__


def test_help_and_an_unknown_command_get_the_whole_parser() -> None:
    assert set(_commands(parser_for(["--help"]))) == set(FAMILY_OF)
    assert set(_commands(parser_for(["bogus"]))) == set(FAMILY_OF)
    assert set(_commands(parser_for([]))) == set(FAMILY_OF)


def test_a_status_call_imports_no_other_family() -> None:
    code = (
        "import json, sys; from runtime.cli import parser_for; parser_for(['status'])\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('runtime.cli.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = {m.removeprefix("runtime.cli.") for m in json.loads(out.stdout)}
    assert "node" in loaded and loaded.isdisjoint({"placement", "replay", "journal", "model", "generate", "keys"})
