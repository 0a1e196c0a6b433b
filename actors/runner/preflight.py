"""Before a start (runner shell): reads what worker-side admission decides on, and performs the claim.

It reads the node's ledger (`MESH_RESERVATIONS`, key `node.<id>`) and telemetry (`MESH_NODES`), and the model
file a reservation names. Any node may write any ledger (placement books everywhere), so the ledger is hostile
input: a deleted or purged one is no ledger, at the revision of its marker (a compare-and-set on 0 would fail for
ever, and nothing would be booked again); one that does not decode is logged as an error and, for the runner's
upkeep, read as no ledger at its revision, so `upkeep` writes what runs over it instead of stopping at it (a
start still refuses it: `ledger_unreadable`). The model file's name comes from that ledger, so it is hostile
too: it is resolved and opened by `runtime.model_files` (no NUL, no 200 KB name, no `../` out of the models
dir, nothing but a regular file, never a blocking open of a FIFO), in a worker thread, and every failure is a
`StartRefused(model_unreadable)`, never an exception. A registry-admitted file's blake3 is checked with
`FileDigests` (each file version hashed once); a hash that outlasts the request's budget keeps running, and
a retry waits for the same one. A stamp's companion files (a draft model, a multimodal projector) are read
the same way, always against the digest admission stamped. A file the node lacks (a relative name, not in
the models dir) is first fetched from a peer by the node's files actor (`pull_missing`, `mesh.files.<id>.pull`:
only a file a catalog or trusted registry entry names, at the stamped digest when there is one); a fetch that
outlasts the budget keeps running there, and the start is refused `unavailable` (retry) meanwhile. The
decisions are `actors.runner.start_checks`'s; this module moves bytes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, GGUFHeader, parse_header
from actors.placement.projector import ProjectorError, projector_from_header
from actors.runner.start_checks import StartRefused
from messages.errors import BUSY, LEDGER_UNREADABLE, MODEL_MISMATCH, MODEL_UNREADABLE, UNAVAILABLE
from messages.files import PullReply, PullRequest
from messages.model import ModelGeometry, ProjectorGeometry
from messages.placement import LEDGER_KEY_PREFIX, NodeLedger
from messages.telemetry import NodeResources
from runtime import buckets
from runtime.actor import ActorContext
from runtime.bus import BadMessage, BusError, RemoteError, RequestTimeout, decode_checked, encode
from runtime.model_files import FileDigests, ModelFileError, open_regular, resolve

__all__ = ["FetchFile", "LedgerRead", "ModelFiles", "NodeState", "ProjectorFile", "pull_missing"]

_Facts = TypeVar("_Facts", ModelGeometry, ProjectorGeometry)

#: Brings a file this node lacks (its relative name, the stamped digest or None) from a peer within a budget;
#: raises `StartRefused` when it cannot be had now.
FetchFile = Callable[[str, str | None, float], Awaitable[None]]


@dataclass(frozen=True)
class LedgerRead:
    ledger: NodeLedger | None
    revision: int  # what a compare-and-set compares with: 0 when the key never held anything
    unreadable: str = ""  # why the stored value does not decode ("": it does, or there is none)


class NodeState:
    """The node's ledger and telemetry, read from their buckets; the claim written with compare-and-set."""

    def __init__(self, node_id: str, kv_timeout_s: float) -> None:
        self.node_id = node_id
        self._timeout = kv_timeout_s
        self._unreadable_at: int | None = None  # the revision last read that did not decode

    @property
    def key(self) -> str:
        return f"{LEDGER_KEY_PREFIX}{self.node_id}"

    async def ledger(self, ctx: ActorContext, *, strict: bool = True) -> LedgerRead:
        """The ledger and its revision. A value that does not decode is logged as an error; `strict` refuses it
        (`ledger_unreadable`: a start cannot find its reservation in it), else it reads as no ledger at its
        revision with `unreadable` saying why, so that what runs is written over it."""
        try:
            async with asyncio.timeout(self._timeout):
                kv = await buckets.reservations(ctx.bus, ctx.subjects)
                entry = await kv.get(self.key)
        except nats.js.errors.KeyNotFoundError as exc:
            # A delete or purge marker is no ledger, but the next write must name the marker's revision.
            marker = getattr(exc, "entry", None)
            return LedgerRead(None, (marker.revision or 0) if marker is not None else 0)
        except (nats.errors.Error, TimeoutError) as exc:
            raise StartRefused(UNAVAILABLE, f"cannot read the reservations bucket: {exc!r}", releases=False) from exc
        revision = entry.revision or 0
        if not entry.value:
            return LedgerRead(None, revision)
        try:
            ledger = decode_checked(entry.value, NodeLedger, f"ledger of node {self.node_id}")
        except BadMessage as exc:
            self._unreadable_at = revision
            ctx.log.error(
                "ledger_unreadable", revision=revision, bytes=len(entry.value), error=_short(str(exc)), strict=strict
            )
            if strict:
                raise StartRefused(LEDGER_UNREADABLE, str(exc), releases=False) from exc
            return LedgerRead(None, revision, unreadable=str(exc))
        return LedgerRead(ledger, revision)

    async def write_ledger(self, ctx: ActorContext, ledger: NodeLedger, revision: int) -> bool:
        """Compare-and-set on `revision`; False when someone else wrote first."""
        try:
            async with asyncio.timeout(self._timeout):
                kv: KeyValue = await buckets.reservations(ctx.bus, ctx.subjects)
                written = await kv.update(self.key, encode(ledger), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        except (nats.errors.Error, TimeoutError) as exc:
            raise StartRefused(UNAVAILABLE, f"cannot write the reservations bucket: {exc!r}", releases=False) from exc
        if revision and revision == self._unreadable_at:
            self._unreadable_at = None
            ctx.log.error(
                "unreadable_ledger_replaced", replaced=revision, revision=written,
                reservations=[r.reservation_id for r in ledger.reservations],
            )  # fmt: skip
        return True

    async def telemetry(self, ctx: ActorContext) -> NodeResources | None:
        """The node's own last report (None when it expired or does not decode)."""
        try:
            async with asyncio.timeout(self._timeout):
                kv = await buckets.nodes(ctx.bus, ctx.subjects)
                entry = await kv.get(self.node_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            raise StartRefused(UNAVAILABLE, f"cannot read the nodes bucket: {exc!r}", releases=False) from exc
        if not entry.value:  # expired: a delete marker
            return None
        try:
            return decode_checked(entry.value, NodeResources, f"telemetry of node {self.node_id}")
        except BadMessage:
            return None


@dataclass(frozen=True)
class ModelFile:
    path: Path  # the file this node runs (a relative name resolved inside the models dir)
    geometry: ModelGeometry


@dataclass(frozen=True)
class ProjectorFile:
    path: Path  # the projector this node runs (`--mmproj`)
    projector: ProjectorGeometry


class ModelFiles:
    """Reads model files named by reservations: which file, its header facts, its digest."""

    def __init__(self, models_dir: Path, digests: FileDigests | None = None) -> None:
        self.models_dir = models_dir
        self.digests = digests or FileDigests()
        self._hashing: dict[Path, asyncio.Future[str]] = {}  # hashes in flight (they outlive a request)

    async def read(self, name: str, digest: str | None, budget_s: float, fetch: FetchFile | None = None) -> ModelFile:
        """The model `name` names, its header read; with `digest`, the file must have that blake3. The header
        and the digest share `budget_s`, so a start answers within the request deadline. With `fetch`, a file
        missing here is fetched from a peer first (within the same budget)."""
        path, geometry = await self._read(name, digest, budget_s, geometry_from_header, "model", fetch)
        return ModelFile(path, geometry)

    async def read_projector(self, name: str, digest: str | None, budget_s: float) -> ProjectorFile:
        """A multimodal projector (`--mmproj`), read like a model: its header's facts, its digest checked."""
        path, projector = await self._read(name, digest, budget_s, projector_from_header, "mmproj")
        return ProjectorFile(path, projector)

    async def _read(
        self,
        name: str,
        digest: str | None,
        budget_s: float,
        facts: Callable[[GGUFHeader], _Facts],
        role: str,
        fetch: FetchFile | None = None,
    ) -> tuple[Path, _Facts]:
        loop = asyncio.get_running_loop()
        until = loop.time() + budget_s
        if fetch is not None and await asyncio.to_thread(_missing, name, self.models_dir):
            await fetch(name, digest, max(0.0, until - loop.time()))
        try:
            async with asyncio.timeout_at(until):
                path, found = await asyncio.to_thread(_read_facts, name, self.models_dir, facts)
        except TimeoutError as exc:
            raise StartRefused(
                UNAVAILABLE, f"reading the header of {name[:200]!r} took over {budget_s:g}s; retry", releases=False
            ) from exc
        except (ModelFileError, GGUFFormatError, GeometryError, ProjectorError, OSError, ValueError) as exc:
            raise StartRefused(MODEL_UNREADABLE, f"cannot use {role} {_short(name)}: {exc}", releases=True) from exc
        if digest is not None:
            actual = await self._digest(path, until, budget_s)
            if actual != digest:
                raise StartRefused(
                    MODEL_MISMATCH,
                    f"{path} is not the file admission was made for (blake3 {actual[:16]}…, expected {digest[:16]}…)",
                    releases=True,
                )
        return path, found

    async def _digest(self, path: Path, until: float, budget_s: float) -> str:
        future = self._hashing.get(path)
        if future is None:
            # an executor future, not a task: it completes with its thread whether or not anyone awaits it
            future = asyncio.get_running_loop().run_in_executor(None, self.digests.digest, path)
            self._hashing[path] = future
            future.add_done_callback(lambda done: self._finished_hash(path, done))
        try:
            async with asyncio.timeout_at(until):
                return await asyncio.shield(future)
        except TimeoutError as exc:
            raise StartRefused(
                UNAVAILABLE,
                f"the blake3 of {path} is still being computed (over {budget_s:g}s so far); retry: "
                "the digest is kept once done",
                releases=False,
            ) from exc
        except (ModelFileError, OSError) as exc:
            raise StartRefused(MODEL_UNREADABLE, f"cannot read {path}: {exc}", releases=True) from exc

    def _finished_hash(self, path: Path, done: asyncio.Future[str]) -> None:
        self._hashing.pop(path, None)
        if not done.cancelled():
            done.exception()  # retrieved: a hash nobody waited for any more must not warn when it failed


def _read_facts(name: str, models_dir: Path, facts: Callable[[GGUFHeader], _Facts]) -> tuple[Path, _Facts]:
    """Worker thread: resolves `name`, opens it without blocking on a FIFO, reads its header's facts."""
    path = resolve(name, models_dir)
    fd, key = open_regular(path)
    with os.fdopen(fd, "rb") as handle:
        header = parse_header(handle, key.size, source=str(path))
    return path, facts(header)


def _missing(name: str, models_dir: Path) -> bool:
    """Worker thread: whether `name` is a relative name inside the models dir with no file there yet (a bad
    name is not "missing": reading it says what is wrong)."""
    if name.startswith("/"):
        return False
    try:
        return not os.path.lexists(resolve(name, models_dir))
    except ModelFileError:
        return False


async def pull_missing(ctx: ActorContext, name: str, digest: str | None, budget_s: float) -> None:
    """`FetchFile` through this node's files actor. A pull still running when the budget ends goes on there (a
    retry waits for it: `busy`), so the start is refused `unavailable` without releasing the reservation; a
    refused pull (no peer holds the file, its bytes were wrong, no space) releases it."""
    subject = ctx.subjects.files(ctx.node_id, "pull")
    request = PullRequest(path=name, blake3=digest)
    fetching = f"{_short(name)} is not on this node and is being fetched from a peer; retry"
    try:
        reply = await ctx.bus.request(subject, request, PullReply, timeout=max(budget_s, 0.1))
    except RequestTimeout as exc:
        raise StartRefused(UNAVAILABLE, fetching, releases=False) from exc
    except RemoteError as exc:
        if exc.code in (BUSY, UNAVAILABLE):
            raise StartRefused(UNAVAILABLE, f"{fetching} ({exc.reply.message})", releases=False) from exc
        message = f"{_short(name)} is not on this node and cannot be fetched: {exc.reply.message}"
        raise StartRefused(MODEL_UNREADABLE, message, releases=True) from exc
    except BusError as exc:
        message = f"{_short(name)} is not on this node and cannot be fetched: {exc}"
        raise StartRefused(MODEL_UNREADABLE, message, releases=True) from exc
    ctx.log.info("model_file_fetched", path=reply.path, peer=reply.peer, bytes=reply.size, moved=reply.moved_bytes)


def _short(name: str) -> str:
    """A hostile name, shown so a person can recognise it without a 200 KB message."""
    return repr(name) if len(name) <= 200 else f"{name[:120]!r}… ({len(name)} characters)"
