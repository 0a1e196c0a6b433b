"""The L3 cores stay pure: no os, asyncio, time, nats (or other I/O) imports; only the store shell does I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

L3 = Path(__file__).resolve().parents[2] / "actors" / "l3"
CORES = ["identity.py", "layout.py", "commit.py", "budget.py", "prefix.py"]
FORBIDDEN = {"os", "asyncio", "time", "nats", "pathlib", "shutil", "subprocess", "socket", "io", "threading", "random"}


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("core", CORES)
def test_an_l3_core_imports_nothing_that_does_io_or_keeps_time(core: str) -> None:
    assert not _imported(L3 / core) & FORBIDDEN


@pytest.mark.parametrize("core", CORES)
def test_an_l3_core_does_not_import_the_store_shell(core: str) -> None:
    tree = ast.parse((L3 / core).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "actors.l3.store" not in modules
