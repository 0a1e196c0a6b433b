"""One registry of error codes (`messages.errors.REGISTRY`): every code the code base can put on the wire is in it.

The wire's codes are the first argument (or `code=`) of `RequestError`, `ErrorReply`, the front door's
`ApiError` and the runner's `StartRefused`. Each such argument that names a value (a constant, a module's
name for one, a string) is resolved in its module and must be a registered code; arguments computed at run
time (a peer's code passed on, a table's value) are checked where the table is (`_CODES` of the files actor).
The bus's numeric header and the front door's status both read the registry.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import pytest

from messages.errors import (
    BUSY,
    REGISTRY,
    SETTINGS_DRIFT,
    ErrorReply,
    http_status,
)
from runtime.bus import error_headers

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "runtime", "messages")
#: Calls whose first argument is a code that crosses the bus (or becomes an HTTP error).
CARRIERS = frozenset({"RequestError", "ErrorReply", "ApiError"})


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.append((".".join(path.relative_to(ROOT).with_suffix("").parts), path))
    return found


def _code_argument(call: ast.Call) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "code":
            return keyword.value
    return call.args[0] if call.args else None


def _carrier(call: ast.Call, module: str) -> bool:
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    # the runner's start refusals become RequestErrors with their code (`RunnerActor._refused`)
    return name in CARRIERS or (name == "StartRefused" and module.startswith("actors.runner"))


def _resolve(node: ast.expr, namespace: dict[str, Any]) -> str | None:
    """The code an argument names, or None when it is computed at run time."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(namespace.get(node.id), str) and node.id.isupper():
        return str(namespace[node.id])
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.isupper():
        holder = namespace.get(node.value.id)
        value = getattr(holder, node.attr, None)
        return value if isinstance(value, str) else None
    return None


def codes_raised() -> list[tuple[str, int, str]]:
    """(module, line, code) of every code named where it is raised."""
    raised = []
    for module, path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _carrier(n, module)]
        if not calls:
            continue
        namespace = vars(importlib.import_module(module))
        for call in calls:
            argument = _code_argument(call)
            code = _resolve(argument, namespace) if argument is not None else None
            if code is not None:
                raised.append((module, call.lineno, code))
    return raised


def test_every_code_raised_anywhere_is_in_the_registry() -> None:
    raised = codes_raised()
    assert len(raised) > 100, "the scan finds the code base's raises"  # it looked where the codes are
    unknown = [f"{module}:{line}: {code}" for module, line, code in raised if code not in REGISTRY]
    assert not unknown, f"codes raised but not in messages/errors.py's REGISTRY: {unknown}"


def test_the_files_actors_table_maps_every_reason_to_a_registered_code() -> None:
    from actors.files.actor import _CODES
    from actors.files.transfer import TransferReason

    assert set(_CODES) <= set(TransferReason)
    assert all(code in REGISTRY for code in _CODES.values())


@pytest.mark.parametrize("code", sorted(REGISTRY))
def test_the_bus_header_and_the_http_status_are_the_registrys(code: str) -> None:
    headers = error_headers(ErrorReply(code=code, message="m"))
    assert headers["Nats-Service-Error-Code"] == str(REGISTRY[code].http_status) == str(http_status(code))
    assert headers["Mesh-Error"] == code


def test_busy_is_429_on_the_bus_as_at_the_front_door_and_a_rule_of_the_runner_is_registered() -> None:
    # issue 25: the bus said 503 for `busy` while the registry said 429; the runner's codes were outside it (502)
    assert error_headers(ErrorReply(code=BUSY, message="m"))["Nats-Service-Error-Code"] == "429"
    assert http_status(SETTINGS_DRIFT) == 409 and not REGISTRY[SETTINGS_DRIFT].retryable
    assert http_status("a-peers-newer-code") == 502
