"""The import rules of the design, enforced (shared/DESIGN.md, "Layout"; docs/architecture.md).

Each actor's package map (`actors/<actor>/__init__.py`) declares its pure cores (`CORES`) and the in-process
interfaces other actors' shells may use (`INTERFACES`); every other module of the package is a shell.
`runtime/__init__.py` declares the runtime modules a core may use. The rules, read from the source (nothing
is imported, so a module with side effects cannot hide from them):

* `messages/` imports nothing of ours but `messages/`.
* A core imports no I/O, clock or randomness (`nats`, `asyncio`, `os`, `time`, `aiohttp`, threads, files,
  sockets, random ids, logging) and of ours only `messages/`, other cores (of any actor) and runtime cores.
  That is what makes `mesh-actor replay` possible.
* An interface imports no shell, nor `nats`, `asyncio`, `aiohttp`: it is types the two sides share.
* A shell imports another actor's cores and interfaces, never its shell: actors couple by subjects and
  messages, and in-process only through an interface.
* `runtime/` imports no actor, except the two places that wire actors together (`runtime/launcher.py`,
  `runtime/cli/`), and nothing outside them imports those two.
* No module of ours imports itself through others (no import cycle, deferred and TYPE_CHECKING imports
  included): a module that needs its importer's type names a Protocol of its own.

Exceptions are listed below, each with its reason; one that no longer happens fails the test, so the list
only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What a core may not import (top-level package names): I/O, clocks, randomness, logging.
NOT_IN_CORES = frozenset(
    {
        "nats", "asyncio", "os", "time", "aiohttp", "subprocess", "socket", "ssl", "select", "selectors",
        "threading", "multiprocessing", "concurrent", "shutil", "tempfile", "pathlib", "io", "random", "secrets",
        "uuid", "datetime", "logging", "structlog", "urllib", "http",
    }
)  # fmt: skip
#: What an interface may not import: it describes calls, it makes none.
NOT_IN_INTERFACES = frozenset({"nats", "asyncio", "aiohttp", "subprocess", "socket", "threading", "structlog"})


#: (importing module, imported module) -> why it is allowed for now.
EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted
    path: Path
    actor: str | None  # the actor package it belongs to
    kind: str  # "core", "interface", "shell", "package", "messages", "runtime", "runtime-core", "wiring"


def _declared(package: Path, name: str) -> frozenset[str]:
    """A `NAME = frozenset({...})` of a package map, read without importing it."""
    init = package / "__init__.py"
    if not init.exists():
        return frozenset()
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        target: ast.expr | None = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == name and isinstance(value, ast.Call):
            (members,) = value.args
            return frozenset(ast.literal_eval(members))
    return frozenset()


def _modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for package in sorted((ROOT / "actors").iterdir()):
        if not package.is_dir() or package.name.startswith(("_", ".")):
            continue
        actor = package.name
        cores, interfaces = _declared(package, "CORES"), _declared(package, "INTERFACES")
        files = {p.stem for p in package.glob("*.py")}
        assert cores | interfaces <= files, (
            f"actors/{actor}: declared modules that do not exist: {(cores | interfaces) - files}"
        )
        for path in sorted(package.glob("*.py")):
            stem = path.stem
            kind = (
                "package"
                if stem == "__init__"
                else "core"
                if stem in cores
                else "interface"
                if stem in interfaces
                else "shell"
            )
            name = f"actors.{actor}" if stem == "__init__" else f"actors.{actor}.{stem}"
            found[name] = Module(name, path, actor, kind)
    for path in sorted((ROOT / "messages").glob("*.py")):
        name = "messages" if path.stem == "__init__" else f"messages.{path.stem}"
        found[name] = Module(name, path, None, "messages")
    runtime_cores = _declared(ROOT / "runtime", "CORES")
    assert runtime_cores <= {p.stem for p in (ROOT / "runtime").glob("*.py")}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        wiring = name == "runtime.launcher" or name.startswith("runtime.cli")
        kind = "wiring" if wiring else "runtime-core" if parts[-1] in runtime_cores else "runtime"
        found[name] = Module(name, path, None, kind)
    return found


def _imports(module: Module, known: dict[str, Module]) -> Iterator[tuple[str, int]]:
    """Every module it imports (anywhere in the file: deferred and TYPE_CHECKING imports couple it too), with
    the line; `from package import name` is the submodule when there is one."""
    package = module.name if module.path.stem == "__init__" else module.name.rpartition(".")[0]
    for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def _verdict(module: Module, imported: str, known: dict[str, Module]) -> str | None:
    """Why `module` may not import `imported`; None when it may."""
    top = imported.split(".")[0]
    target = known.get(imported)
    ours = top in ("actors", "messages", "runtime")
    if module.kind == "messages":
        return "messages/ imports nothing of ours but messages/" if ours and top != "messages" else None
    if module.kind in ("core", "runtime-core"):
        if top in NOT_IN_CORES:
            return f"a pure core imports no {top} (inject it)"
        if ours and (target is None or target.kind not in ("core", "runtime-core", "messages", "package")):
            return f"a pure core imports only messages/ and cores, not the {target.kind if target else '?'} {imported}"
        return None
    if module.kind == "interface":
        if top in NOT_IN_INTERFACES:
            return f"an interface imports no {top}"
        if ours and target is not None and target.kind in ("shell", "wiring"):
            return f"an interface imports no shell ({imported})"
        return None
    if target is not None and target.kind == "wiring" and module.kind != "wiring":
        return "nothing imports the launcher or the CLI: they wire actors together"
    if module.kind == "runtime" and top == "actors":
        return "runtime/ imports no actor (only the launcher and the CLI wire them)"
    if module.kind not in ("shell", "package") or target is None or target.actor in (None, module.actor):
        return None
    if target.kind not in ("core", "interface", "package"):
        return f"a shell imports another actor's cores and interfaces only, not its shell {imported}"
    return None


def _violations() -> dict[tuple[str, str], str]:
    known = _modules()
    found: dict[tuple[str, str], str] = {}
    for module in known.values():
        for imported, line in _imports(module, known):
            why = _verdict(module, imported, known)
            if why is not None:
                found[(module.name, imported)] = f"{module.path.relative_to(ROOT)}:{line}: {why}"
    return found


def test_every_import_keeps_the_rules_of_the_design() -> None:
    violations = {pair: why for pair, why in _violations().items() if pair not in EXCEPTIONS}
    assert not violations, "\n".join(sorted(violations.values()))


def test_every_listed_exception_still_happens() -> None:
    stale = set(EXCEPTIONS) - set(_violations())
    assert not stale, f"no longer needed, remove from EXCEPTIONS: {sorted(stale)}"


def test_the_rules_see_what_they_forbid() -> None:
    # The checker itself: a core importing asyncio or a shell, a shell importing another actor's shell.
    known = _modules()
    core, shell = known["actors.router.routing"], known["actors.router.actor"]
    assert _verdict(core, "asyncio", known) is not None
    assert _verdict(core, "actors.router.actor", known) is not None
    assert _verdict(core, "runtime.bus", known) is not None
    assert _verdict(core, "actors.handoff.cost", known) is None
    assert _verdict(shell, "actors.l3.actor", known) is not None
    assert _verdict(shell, "actors.l3.api", known) is None
    assert _verdict(known["runtime.bus"], "actors.l3.actor", known) is not None
    assert _verdict(shell, "runtime.launcher", known) is not None
    assert _verdict(known["messages.events"], "runtime.bus", known) is not None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (its strongly connected components of more than one module), Tarjan's."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                cycles.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for module in known.values():
        for imported, _ in _imports(module, known):
            while imported and imported not in known:  # `from actors.l3.store import Store`: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != module.name and known[imported].kind != "package":
                graph[module.name].add(imported)
    return graph


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _test_module_imports() -> list[str]:
    """Imports of a test module (`tests/unit|integration|e2e/test_*.py`) by any module under tests/: shared
    helpers live in `tests/harness`, so a test module is free to change without breaking another."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:]):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    return found


def test_tests_share_helpers_through_the_harness_not_each_other() -> None:
    assert _test_module_imports() == []
