"""Files actor (shell): model files this node holds, served to peers by name and digest, and pulls from peers.

* `mesh.files.<node>.held`: whether this node holds the file of a relative name, and its size and blake3
  (hashed once per file version, `FileDigests`). Only names this node's own catalog (`models.toml` in its data
  dir) or a registry entry signed by a key it trusts gives are answered; anything else is `not_found`, whether
  it exists or not. Not the front doors' reports in `MESH_FRONTDOORS`: any node writes its own, so a peer's
  report naming a file would make a file of this node's models dir that no catalog here names travel. The
  registry is watched (its names are known as they change, no bucket read per request); the names (and their
  resolved files) are worked out again at most every `names_ttl_s`, so a chunk costs no catalog read.
* `mesh.files.<node>.facts`: the same, with the header's facts (`ModelGeometry`): what placement on a node
  without the file admits it by.
* `mesh.files.<node>.chunk`: one chunk of such a file, asked by name and whole-file digest (a file that now
  hashes otherwise is `not_found`), with the chunk's own blake3 in a header.
* `mesh.files.<node>.pull`: fetch the file of a catalog model or registry entry into this node's models dir
  (an operator's `mesh-actor models pull`), or a file by relative name at a stamped digest (the node's own
  runner, for a start whose file is missing: `runner/preflight.pull_missing`). The relative name is this
  node's catalog's (or the signed entry's), the destination that name inside the models dir (resolved,
  symlinks followed, never outside), so no peer names a path here. The holders are asked (`held`,
  concurrently, each under a deadline); the version fetched is the signed one for a registry entry, else the
  one most holders state (`transfer.choose_source`); the free space is checked, less what the other pulls in
  flight have still to write (each reserves its bytes until it ends) and `keep_free_bytes`; the part file kept
  from an interrupted pull of the same version is verified again and resumed (`part`); chunks are asked
  `window` at a time, each checked (`transfer.check_chunk`) and written in order, in one worker-thread hop; the
  whole file must hash to the digest (`transfer.final_refusal`) before it is renamed into place. A refused
  file is deleted; a peer that stops answering leaves the verified part for the next pull. Every pull is
  journaled (`model_file_pulled`, `model_file_pull_refused`).

One pull per destination at a time (a second is `busy`). Refusals are error replies with `details.reason`
(`transfer.TransferReason`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import stat
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, TypeVar

import blake3
import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from actors.files import part as parts
from actors.files import transfer
from actors.files.transfer import Holder, TransferReason, TransferRefusal
from actors.frontdoor.catalog import CATALOG_FILE, CatalogError, parse_catalog
from actors.placement.geometry import GeometryError, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, parse_header
from actors.placement.registry import RegistryUntrusted, verify
from messages.datapath import DirectOffer
from messages.errors import BAD_REQUEST, BUSY, ERROR_HEADER, MESH_ERROR_HEADER, NOT_FOUND, UNAVAILABLE
from messages.events import ModelFilePulled, ModelFilePullRefused
from messages.files import (
    FILES_BLAKE3_HEADER,
    FILES_OFFSET_HEADER,
    FILES_TOTAL_HEADER,
    ChunkRequest,
    FileFacts,
    FileHeld,
    HeldRequest,
    OfferRequest,
    PullReply,
    PullRequest,
)
from messages.model import ModelGeometry
from messages.registry import RegistryEntry
from messages.telemetry import MAX_MODEL_FILES, ModelFiles, NodeResources
from runtime import buckets
from runtime.actor import Actor, ActorContext, RawReply, RequestError
from runtime.bus import BadMessage, BusError, decode_checked, encode, parse_reply
from runtime.datapath import (
    ChunkReader,
    DataFailed,
    DataLimits,
    DataListener,
    DataPathConfig,
    DataUnavailable,
    Handler,
    fetch_range,
    send_file_range,
    send_range,
)
from runtime.durable import make_dir
from runtime.model_files import FileDigests, FileKey, ModelFileError, open_regular, resolve
from runtime.tickets import Grant, TicketRefusal

__all__ = ["FilesActor", "FilesLimits"]

T = TypeVar("T")

#: File versions whose chunk digests are remembered for sending again with sendfile (32 B a chunk: 32 KiB a GiB).
_HASHED_VERSIONS: Final = 16

#: The error code of each refusal (the reason itself travels in `details.reason`).
_CODES: Final = {
    TransferReason.NOT_NAMED: NOT_FOUND,
    TransferReason.BAD_NAME: BAD_REQUEST,
    TransferReason.NO_PEER: NOT_FOUND,
    TransferReason.NO_SPACE: BAD_REQUEST,
    TransferReason.CHUNK_REFUSED: BAD_REQUEST,
    TransferReason.DIGEST_MISMATCH: BAD_REQUEST,
    TransferReason.SIZE_MISMATCH: BAD_REQUEST,
    TransferReason.PEER_FAILED: UNAVAILABLE,
}


@dataclass(frozen=True, slots=True)
class FilesLimits:
    held_timeout_s: float = 5.0  # a holder's answer to `held` (it may hash the file first: cached afterwards)
    chunk_timeout_s: float = 10.0  # one chunk request; a stalled peer is given up after this
    window: int = 8  # chunk requests in flight during a pull
    chunk_workers: int = 8  # chunks served concurrently
    pull_deadline_s: float = 6 * 3600.0  # a pull never outlives this
    keep_free_bytes: int = 1 << 30  # what pulls leave free on the models dir's file system (as handoff's staging)
    max_holders: int = 64  # nodes asked whether they hold a file
    names_ttl_s: float = 2.0  # how long the names this node serves are cached (its catalog, the registry)
    holdings_every_s: float = 5.0  # how often the files held (`holdings`, in telemetry) are looked at again
    threads: int = 4  # worker threads for file I/O and hashing


class _Refused(Exception):
    def __init__(self, refusal: TransferRefusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal
        self.path = ""  # the relative name, once known
        self.peer = ""  # the peer whose bytes were refused


class _PeerFailed(Exception):
    """A peer stopped answering or answered an error: the part is kept."""


class FilesActor(Actor):
    name = "files"

    def __init__(
        self,
        node_id: str,
        data_dir: Path,
        *,
        models_dir: Path,
        digests: FileDigests | None = None,
        trusted_registry_keys: tuple[str, ...] = (),
        limits: FilesLimits | None = None,
        free_space: Callable[[Path], int] = parts.free_bytes,
        datapath: DataPathConfig | None = None,
    ) -> None:
        """`free_space` is the bytes a directory's file system may still take (a test seam: a file system of
        any size without mounting one). `datapath`: where this node's data listener listens and with which
        certificates (None: no direct path; every byte over NATS)."""
        self.node_id = node_id
        self.data_dir = data_dir
        self.models_dir = models_dir
        self.digests = digests or FileDigests()
        self.trusted = trusted_registry_keys
        self.limits = limits or FilesLimits()
        self._ctx: ActorContext | None = None
        self._pulling: set[str] = set()
        self._free_space = free_space
        #: The pulls writing now (relative name -> its file system's device and part file): what each has still
        #: to write is owed, so a pull that starts meanwhile counts it as taken.
        self._writing: dict[str, tuple[int, parts.PartFile]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.running = False  # its endpoints are served
        self._names: tuple[float, set[str]] | None = None  # (when, the names served) cached briefly
        self._resolved: dict[str, Path] = {}  # served names -> their files, while the names are cached
        #: The named files this node holds and its last pull's rate: what its telemetry reports (`ModelFiles`).
        self.holdings = ModelFiles()
        self._look_again = asyncio.Event()  # a pull landed a file: `holdings` is looked at now
        self._signed: dict[str, RegistryEntry] = {}  # registry key -> its entry, signed by a key trusted here
        self.datapath = datapath
        self.listener: DataListener | None = None  # this incarnation's data listener, while it runs
        #: (file version, chunk size) -> the blake3 of each chunk sent directly so far (by index): a range whose
        #: chunks are all known is sent again with sendfile, untouched by this process (the last few versions).
        self._chunk_digests: OrderedDict[tuple[FileKey, int], dict[int, bytes]] = OrderedDict()

    async def run(self, ctx: ActorContext) -> None:
        self._ctx = ctx
        self._pool = ThreadPoolExecutor(max_workers=self.limits.threads, thread_name_prefix="files")
        s, node, lim = ctx.subjects, self.node_id, self.limits
        self._signed, self._names = {}, None  # a new incarnation reads them afresh
        registry_known = asyncio.Event()
        if self.trusted:
            registry = await buckets.registry(ctx.bus, s)
            ctx.spawn(
                self._watch_into("the registry", registry, registry_known, self._signed, self._trusted_entry),
                "watch-registry",
            )
        else:
            registry_known.set()  # no key trusted: no entry is signed for this node
        async with asyncio.timeout(10):  # a name is never refused for not having been read yet
            await registry_known.wait()
        await ctx.add_endpoint("held", s.files(node, "held"), HeldRequest, self._on_held, workers=2)
        await ctx.add_endpoint("facts", s.files(node, "facts"), HeldRequest, self._on_facts, workers=2)
        await ctx.add_endpoint("chunk", s.files(node, "chunk"), ChunkRequest, self._on_chunk, workers=lim.chunk_workers)
        if self.datapath is not None:
            listener = DataListener(node, self.datapath)
            await listener.start()
            self.listener = listener
            ctx.spawn(self._keep_listener(listener), "data-listener")
        await ctx.add_endpoint("offer", s.files(node, "offer"), OfferRequest, self._on_offer, workers=2)
        await ctx.add_endpoint(
            "pull", s.files(node, "pull"), PullRequest, self._on_pull, workers=2, deadline_s=lim.pull_deadline_s
        )
        ctx.spawn(self._shutdown_pool(), "pool")
        ctx.spawn(self._holdings_loop(ctx), "holdings")
        self.running = True

    async def _shutdown_pool(self) -> None:
        try:
            await asyncio.Event().wait()  # lives as long as the incarnation
        finally:
            self.running = False
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    async def _keep_listener(self, listener: DataListener) -> None:
        try:
            await asyncio.Event().wait()  # lives as long as the incarnation
        finally:
            if self.listener is listener:
                self.listener = None
            await listener.close()

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    # ---- what this node names and holds ----

    async def _holdings_loop(self, ctx: ActorContext) -> None:
        """`holdings` kept current: every `holdings_every_s`, and at once after a pull landed a file."""
        while True:
            names = sorted(await self._servable_names(ctx))
            held = (await self._blocking(self._held_sizes, names))[:MAX_MODEL_FILES]
            if held != self.holdings.held:
                ctx.log.info("model_files_held", files=len(held))
            self.holdings = msgspec.structs.replace(self.holdings, held=held)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.limits.holdings_every_s):
                    await self._look_again.wait()
            self._look_again.clear()

    def _held_sizes(self, names: list[str]) -> tuple[tuple[str, int, str], ...]:
        """(name, size, blake3 if that version was hashed already, else "") of each of `names` that is a regular
        file in the models dir (blocking: a worker thread). Nothing is hashed here."""
        held = []
        for name in names:
            try:
                info = os.stat(resolve(name, self.models_dir))
            except (ModelFileError, OSError):
                continue
            if stat.S_ISREG(info.st_mode):
                key = FileKey(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
                held.append((name, info.st_size, self.digests.known(key) or ""))
        return tuple(held)

    async def _watch_into(
        self,
        what: str,
        kv: KeyValue,
        ready: asyncio.Event,
        held: dict[str, T],
        read: Callable[[KeyValue.Entry], T | None],
    ) -> None:
        """`held` kept as `kv` holds it (key -> `read(entry)`; None: nothing kept for that key), the names worked
        out again after each change. A watch that ends raises: the names would go stale."""
        async for entry in buckets.watch(kv, ready):
            held.pop(entry.key, None)
            if not buckets.removed(entry) and (value := read(entry)) is not None:
                held[entry.key] = value
            self._names = None
        raise BusError(f"the watch of {what} ended")  # the supervisor starts the actor again

    def _trusted_entry(self, entry: KeyValue.Entry) -> RegistryEntry | None:
        """A registry entry signed by a key this node trusts; None for any other (not one this node serves)."""
        try:
            signed = decode_checked(entry.value or b"", RegistryEntry, f"registry entry {entry.key}")
            verify(signed, self.trusted, stored_as=entry.key)
        except (BadMessage, RegistryUntrusted):
            return None
        return signed

    async def _catalog_files(self, ctx: ActorContext) -> dict[str, str]:
        """Model name -> relative file name of every model and companion of this node's own catalog
        (`models.toml`); no peer's report adds to it."""
        named: dict[str, str] = {}
        try:
            text = await self._blocking((self.data_dir / CATALOG_FILE).read_text)
            catalog = parse_catalog(text, CATALOG_FILE)
        except FileNotFoundError:
            catalog = None
        except (OSError, CatalogError) as exc:
            ctx.log.warning("files_catalog_unreadable", error=str(exc))
            catalog = None
        if catalog is not None:
            for name, model in catalog.models.items():
                if not model.registry:
                    named.setdefault(name, model.path)
                for role, companion in (("draft", model.draft), ("mmproj", model.mmproj)):
                    if companion is not None:
                        named.setdefault(f"{name}:{role}", companion)
        return named

    def _registry_entry(self, name: str) -> RegistryEntry | None:
        """The registry entry `name`, when a key this node trusts signed it (None: none, or untrusted)."""
        return self._signed.get(name)

    def _signed_files(self) -> dict[str, RegistryEntry]:
        """File name -> the registry entry naming it, for every entry signed by a key this node trusts."""
        signed: dict[str, RegistryEntry] = {}
        for key in sorted(self._signed):
            signed.setdefault(self._signed[key].file_name, self._signed[key])
        return signed

    def _relative(self, path: str) -> str:
        """A catalog's file name as a name inside the models dir (an absolute one only when it is inside)."""
        if path.startswith("/"):
            try:
                target = resolve(path, self.models_dir, roots=[self.models_dir])
            except ModelFileError as exc:
                raise _Refused(TransferRefusal(TransferReason.BAD_NAME, str(exc))) from exc
            path = str(target.relative_to(Path(os.path.realpath(self.models_dir))))
        refusal = transfer.check_relative(path)
        if refusal is not None:
            raise _Refused(refusal)
        return path

    def _destination(self, relative: str) -> Path:
        try:
            return resolve(relative, self.models_dir)
        except ModelFileError as exc:
            raise _Refused(TransferRefusal(TransferReason.BAD_NAME, str(exc))) from exc

    async def _servable_names(self, ctx: ActorContext) -> set[str]:
        """The relative names this node serves (its catalogs' files and trusted registry entries'), read again
        at most every `names_ttl_s`: a chunk request must not cost a catalog read and bucket reads."""
        now = asyncio.get_running_loop().time()
        cached = self._names
        if cached is not None and now - cached[0] < self.limits.names_ttl_s:
            return cached[1]
        named = set((await self._catalog_files(ctx)).values())
        names = {n for n in named if transfer.check_relative(n) is None}
        for n in named - names:  # an absolute name inside the models dir serves its relative name
            with contextlib.suppress(_Refused):
                names.add(self._relative(n))
        names |= set(self._signed_files())
        self._names = (now, names)
        self._resolved = {}
        return names

    async def _servable(self, ctx: ActorContext, path: str) -> Path:
        """The file a peer asks for by relative name, if a catalog or registry entry names it here."""
        if transfer.check_relative(path) is not None or path not in await self._servable_names(ctx):
            raise RequestError(NOT_FOUND, f"node {self.node_id} serves no file {path[:200]!r}")
        resolved = self._resolved.get(path)
        if resolved is None:
            try:
                resolved = await self._blocking(resolve, path, self.models_dir)
            except ModelFileError as exc:
                raise RequestError(NOT_FOUND, f"node {self.node_id} serves no file {path[:200]!r}") from exc
            self._resolved[path] = resolved  # until the names are read again
        return resolved

    def _same(self, relative: str, named: str) -> bool:
        """Whether a catalog's (possibly absolute) name is the file `relative` names in the models dir."""
        if not named.startswith("/"):
            return False
        try:
            return self._relative(named) == relative
        except _Refused:
            return False

    async def _on_held(self, request: HeldRequest) -> FileHeld:
        ctx = self._ctx
        assert ctx is not None
        path = await self._servable(ctx, request.path)
        try:
            digest = await self._blocking(self.digests.digest, path)
            size = (await self._blocking(os.stat, path)).st_size
        except (ModelFileError, OSError) as exc:
            raise RequestError(NOT_FOUND, f"node {self.node_id} does not hold {request.path!r}") from exc
        if (request.path, size, digest) not in self.holdings.held:
            self._look_again.set()  # its digest is known now: the holdings say which version this node has
        return FileHeld(node_id=self.node_id, path=request.path, size=size, blake3=digest)

    async def _on_facts(self, request: HeldRequest) -> FileFacts:
        """The file's size, blake3 and header facts (placement on a node without the file asks this)."""
        ctx = self._ctx
        assert ctx is not None
        path = await self._servable(ctx, request.path)
        try:
            size, geometry = await self._blocking(_header_facts, path)
            digest = await self._blocking(self.digests.digest, path)
        except (ModelFileError, OSError) as exc:
            raise RequestError(NOT_FOUND, f"node {self.node_id} does not hold {request.path!r}") from exc
        except (GGUFFormatError, GeometryError) as exc:
            raise RequestError(BAD_REQUEST, f"{request.path!r} is not a model this node can read: {exc}") from exc
        return FileFacts(node_id=self.node_id, path=request.path, size=size, blake3=digest, geometry=geometry)

    async def _on_chunk(self, request: ChunkRequest) -> RawReply:
        ctx = self._ctx
        assert ctx is not None
        path = await self._servable(ctx, request.path)
        length = min(request.length, transfer.chunk_bytes(ctx.bus.max_payload))
        try:
            digest, data, total, chunk_digest = await self._blocking(
                _read_hashed, self.digests, path, request.offset, length
            )
        except (ModelFileError, OSError) as exc:
            raise RequestError(NOT_FOUND, f"node {self.node_id} cannot read {request.path!r}") from exc
        if digest != request.blake3:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds another version of {request.path!r}")
        if request.offset >= total:
            raise RequestError(BAD_REQUEST, f"offset {request.offset} is past the file's {total} bytes")
        headers = {FILES_OFFSET_HEADER: str(request.offset), FILES_TOTAL_HEADER: str(total)}
        return RawReply(data, {**headers, FILES_BLAKE3_HEADER: chunk_digest})

    async def _on_offer(self, request: OfferRequest) -> DirectOffer:
        """A one-shot ticket for a range of a file this node serves, at the version asked: the listener sends it
        (each chunk read from that very version, or the connection ends early and the fetcher resumes)."""
        ctx, listener = self._ctx, self.listener
        assert ctx is not None
        if listener is None:
            raise RequestError(UNAVAILABLE, f"node {self.node_id} has no direct data path; use chunks")
        path = await self._servable(ctx, request.path)
        try:
            key, digest = await self._blocking(_version, self.digests, path)
        except (ModelFileError, OSError) as exc:
            raise RequestError(NOT_FOUND, f"node {self.node_id} cannot read {request.path!r}") from exc
        if digest != request.blake3:
            raise RequestError(NOT_FOUND, f"node {self.node_id} holds another version of {request.path!r}")
        if request.offset + request.length > key.size:
            raise RequestError(BAD_REQUEST, f"the range ends past the file's {key.size} bytes")
        limits = listener.limits
        send = self._sender(path, key, request, limits, sendfile=not listener.tls)
        offer = listener.offer(
            send,
            receiver=request.receiver,
            digest=request.blake3,
            offset=request.offset,
            length=request.length,
            chunk=request.chunk,
        )
        if isinstance(offer, TicketRefusal):
            raise RequestError(BUSY, str(offer), {"reason": offer.reason.value})
        return offer

    def _sender(
        self, path: Path, key: FileKey, request: OfferRequest, limits: DataLimits, *, sendfile: bool
    ) -> Handler:
        """What the listener does with the ticket's connection: the range with sendfile when every chunk's blake3
        is known from an earlier send of this version (and the socket is plain: under TLS asyncio's sendfile
        falls back to small reads, slower than reading whole chunks), else read and hashed chunk by chunk (and
        remembered)."""
        chunk = request.chunk
        known = self._chunk_digests.get((key, chunk))
        if known is None:
            known = self._chunk_digests[(key, chunk)] = {}
            while len(self._chunk_digests) > _HASHED_VERSIONS:
                self._chunk_digests.popitem(last=False)
        self._chunk_digests.move_to_end((key, chunk))
        aligned = request.offset % chunk == 0
        first = request.offset // chunk
        count = -(-request.length // chunk)
        digests = [known.get(first + i) for i in range(count)] if aligned else []
        if sendfile and aligned and all(d is not None for d in digests):
            ready = [d for d in digests if d is not None]

            async def send_known(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, grant: Grant[Any]) -> None:
                await send_file_range(writer, grant, lambda: _open_version(path, key), ready, limits)

            return send_known
        read = _version_reader(path, key)

        def read_and_remember(offset: int, length: int) -> tuple[bytes, bytes]:  # worker threads
            data, digest = read(offset, length)
            if aligned and len(data) == length:
                known[offset // chunk] = digest
            return data, digest

        async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, grant: Grant[Any]) -> None:
            await send_range(writer, grant, read_and_remember, limits)

        return send

    # ---- pull ----

    async def _on_pull(self, request: PullRequest) -> PullReply:
        ctx = self._ctx
        assert ctx is not None
        try:
            return await self._pull(ctx, request)
        except _Refused as exc:
            refusal = exc.refusal
            ctx.log.warning(
                "file_pull_refused",
                model=request.name,
                path=exc.path,
                reason=refusal.reason.value,
                detail=refusal.detail,
            )
            ctx.emit(
                ModelFilePullRefused,
                name=request.name or "",
                path=exc.path,
                reason=refusal.reason.value,
                detail=refusal.detail,
                peer=exc.peer,
            )
            raise RequestError(_CODES[refusal.reason], str(refusal), {"reason": refusal.reason.value}) from exc

    async def _pull(self, ctx: ActorContext, request: PullRequest) -> PullReply:
        if (request.name is None) == (request.path is None):
            raise RequestError(BAD_REQUEST, "name a catalog model (name) or a file (path), one of them")
        named = await self._catalog_files(ctx)
        digest, size = request.blake3, None
        if request.path is not None:
            relative = self._relative(request.path)
            signed = self._signed_files()
            if relative in signed:
                signed_entry = signed[relative]
                if digest not in (None, signed_entry.blake3):
                    raise _Refused(
                        TransferRefusal(
                            TransferReason.NOT_NAMED, f"no trusted registry entry names that version of {relative!r}"
                        )
                    )
                digest, size = signed_entry.blake3, signed_entry.size_bytes
            elif relative not in named.values() and not any(self._same(relative, n) for n in named.values()):
                raise _Refused(
                    TransferRefusal(
                        TransferReason.NOT_NAMED, f"no catalog model or trusted registry entry names {relative!r}"
                    )
                )
        elif request.name in named:
            relative = self._relative(named[request.name])
        elif (entry := self._registry_entry(request.name or "")) is not None:
            relative, digest, size = self._relative(entry.file_name), entry.blake3, entry.size_bytes
        else:
            raise _Refused(
                TransferRefusal(
                    TransferReason.NOT_NAMED, f"no catalog model or trusted registry entry {request.name!r}"
                )
            )
        dest = await self._blocking(self._destination, relative)
        if relative in self._pulling:
            raise RequestError(BUSY, f"{relative!r} is being pulled already; retry")
        self._pulling.add(relative)
        try:
            return await self._pull_file(ctx, request, relative, dest, digest, size)
        except _Refused as exc:
            exc.path = relative
            raise
        finally:
            self._pulling.discard(relative)

    async def _pull_file(
        self, ctx: ActorContext, request: PullRequest, relative: str, dest: Path, digest: str | None, size: int | None
    ) -> PullReply:
        here = PullReply(node_id=self.node_id, name=request.name or "", path=relative, size=0, blake3="0" * 64)
        if await self._blocking(os.path.lexists, dest):
            try:
                have = await self._blocking(self.digests.digest, dest)
                have_size = (await self._blocking(os.stat, dest)).st_size
            except (ModelFileError, OSError) as exc:
                raise _Refused(
                    TransferRefusal(TransferReason.BAD_NAME, f"{relative!r} exists here but is unusable: {exc}")
                ) from exc
            if digest is not None and have != digest:
                raise _Refused(
                    TransferRefusal(
                        TransferReason.DIGEST_MISMATCH, f"{relative!r} here hashes to {have[:16]}…, not the signed one"
                    )
                )
            return msgspec.structs.replace(here, size=have_size, blake3=have, already=True)
        holders = await self._holders(ctx, relative, request.peer)
        source = transfer.choose_source(holders, digest=digest, size=size)
        if isinstance(source, TransferRefusal):
            raise _Refused(source)
        directory = dest.parent
        if not await self._blocking(directory.is_dir):
            await self._blocking(make_dir, directory)
        chunk = transfer.chunk_bytes(ctx.bus.max_payload)
        started = time.monotonic()
        part = await self._blocking(parts.open_part, directory, dest.name, source.digest, source.size, chunk)
        resumed = part.resumed_from
        moved = 0
        failures: list[str] = []
        peer = transport = fallback = ""
        try:
            device = (await self._blocking(os.stat, directory)).st_dev
            free = await self._blocking(self._free_space, directory)
            # No await from here to the reservation: two pulls cannot both count the same free bytes.
            owed = sum(p.size - p.received for dev, p in self._writing.values() if dev == device)
            refusal = transfer.space_refusal(
                free_bytes=free,
                need_bytes=source.size - part.received,
                keep_free_bytes=self.limits.keep_free_bytes,
                owed_bytes=owed,
            )
            if refusal is not None:
                raise _Refused(refusal)
            self._writing[relative] = (device, part)
            for peer in source.peers:
                before = part.received
                try:
                    transport, fallback = await self._fetch(ctx, peer, relative, part)
                    moved += part.received - before
                    break
                except _PeerFailed as exc:
                    moved += part.received - before
                    failures.append(f"{peer}: {exc}")
                    ctx.log.warning("file_pull_peer_failed", peer=peer, path=relative, error=str(exc))
            else:
                raise _Refused(TransferRefusal(TransferReason.PEER_FAILED, "; ".join(failures) or "no holder answered"))
            observed = await self._blocking(part.finish)
            refusal = transfer.final_refusal(
                digest=source.digest, size=source.size, observed=observed, received=part.received
            )
            if refusal is not None:
                raise _Refused(refusal)
            await self._blocking(part.land, dest)
            with contextlib.suppress(ModelFileError):  # verified whole: the runner need not hash it again
                await self._blocking(self.digests.remember, dest, source.digest)
        except _Refused as exc:
            exc.peer = (
                peer if exc.refusal.reason in (TransferReason.CHUNK_REFUSED, TransferReason.DIGEST_MISMATCH) else ""
            )
            if exc.refusal.reason in (TransferReason.PEER_FAILED, TransferReason.NO_SPACE) and part.received:
                await self._blocking(part.close)  # kept: the next pull resumes from its verified length
            else:
                await self._blocking(part.discard)  # wrong bytes (or nothing yet): nothing of them is left
            raise
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                await self._blocking(part.close)
                raise
            # the file system filled up under the pull: what was verified stays for a later pull
            await self._blocking(part.close if part.received else part.discard)
            raise _Refused(
                TransferRefusal(TransferReason.NO_SPACE, f"the file system filled up at {part.received} bytes")
            ) from exc
        except BaseException:
            await asyncio.shield(self._blocking(part.close))
            raise
        finally:
            self._writing.pop(relative, None)  # what it has not written is no longer owed
        fetch_ms = round((time.monotonic() - started) * 1000, 3)
        if moved > 0 and fetch_ms > 0:
            self.holdings = msgspec.structs.replace(self.holdings, pull_bytes_per_s=moved / (fetch_ms / 1000))
        self._names = None  # a name may have been added with the pull's catalog
        self._look_again.set()
        ctx.log.info(
            "file_pulled",
            path=relative,
            peer=peer,
            bytes=source.size,
            moved_bytes=moved,
            resumed_from=resumed,
            transport=transport,
            fallback=fallback,
        )
        ctx.emit(
            ModelFilePulled,
            name=request.name or "",
            path=relative,
            blake3=source.digest,
            bytes=source.size,
            peer=peer,
            resumed_from=resumed,
            moved_bytes=moved,
            fetch_ms=fetch_ms,
            transport=transport,
            fallback=fallback[:1024],
        )
        return msgspec.structs.replace(
            here,
            size=source.size,
            blake3=source.digest,
            peer=peer,
            resumed_from=resumed,
            moved_bytes=moved,
            fetch_ms=fetch_ms,
            transport=transport,
            fallback=fallback[:1024],
        )

    async def _holders(self, ctx: ActorContext, relative: str, only: str | None) -> list[Holder]:
        """Every live node (or `only`) that says it holds `relative`, asked concurrently under a deadline."""
        if only is not None:
            nodes = [only]
        else:
            reports, _ = await buckets.read_all(ctx.bus, ctx.subjects.nodes_bucket, NodeResources)
            nodes = sorted({key for key, _ in reports} - {self.node_id})[: self.limits.max_holders]

        async def ask(node: str) -> Holder | None:
            try:
                held = await ctx.bus.request(
                    ctx.subjects.files(node, "held"),
                    HeldRequest(path=relative),
                    FileHeld,
                    timeout=self.limits.held_timeout_s,
                )
            except (BusError, nats.errors.Error) as exc:
                ctx.log.debug("files_not_held", peer=node, path=relative, error=str(exc))
                return None
            return Holder(node=node, size=held.size, digest=held.blake3)

        answers = await asyncio.gather(*(ask(node) for node in nodes))
        return [a for a in answers if a is not None]

    async def _request_chunk(self, ctx: ActorContext, subject: str, request: ChunkRequest) -> Msg | BaseException:
        """A chunk reply, or why none came."""
        try:
            return await ctx.bus.request_raw(subject, encode(request), timeout=self.limits.chunk_timeout_s)
        except (BusError, nats.errors.Error) as exc:
            return exc

    async def _fetch(self, ctx: ActorContext, peer: str, relative: str, part: parts.PartFile) -> tuple[str, str]:
        """The rest of the file from `peer`: over the direct data path when it opens, and over NATS chunk requests
        when it does not or for what it did not bring (a stream that broke off: its verified chunks are kept).
        Returns the path the bytes took (`PullReply.transport`) and why NATS carried bytes, when it did."""
        direct, why = await self._fetch_direct(ctx, peer, relative, part)
        if part.received >= part.size:
            return direct, ""
        await self._fetch_chunks(ctx, peer, relative, part)
        return (f"{direct}+nats" if direct else "nats"), why

    async def _fetch_direct(self, ctx: ActorContext, peer: str, relative: str, part: parts.PartFile) -> tuple[str, str]:
        """What the direct stream from `peer` brings of the rest (a ticket asked on `.offer`); ("", why) when it
        moved nothing. A peer whose frames lie is refused as over NATS; any other failure leaves the rest to NATS."""
        if self.datapath is None:
            return "", "this node has no direct data path"
        length = part.size - part.received
        if length <= 0:
            return "", ""
        request = OfferRequest(
            path=relative, blake3=part.digest, offset=part.received, length=length, chunk=part.chunk,
            receiver=self.node_id,
        )  # fmt: skip
        try:
            offer = await ctx.bus.request(
                ctx.subjects.files(peer, "offer"), request, DirectOffer, timeout=self.limits.held_timeout_s
            )
        except (BusError, nats.errors.Error) as exc:
            return "", f"no ticket from {peer}: {exc}"
        transport = "direct_tls" if offer.tls else "direct"
        before = part.received

        def sink(offset: int, data: memoryview, digest: str) -> None:  # the receiving thread
            part.write(offset, data, digest)

        try:
            await fetch_range(
                offer,
                receiver=self.node_id,
                digest=part.digest,
                offset=request.offset,
                length=length,
                chunk=part.chunk,
                sink=sink,
                tls=self.datapath.tls,
                limits=self.datapath.limits,
                deadline_s=self.limits.pull_deadline_s,
            )
        except DataUnavailable as exc:
            ctx.log.info("file_direct_unavailable", peer=peer, path=relative, error=str(exc))
            return "", str(exc)
        except DataFailed as exc:
            if exc.reason in ("chunk_refused", "frame_refused"):
                raise _Refused(TransferRefusal(TransferReason.CHUNK_REFUSED, f"over the direct path: {exc}")) from exc
            ctx.log.warning("file_direct_failed", peer=peer, path=relative, error=str(exc), kept=part.received)
            return (transport if part.received > before else ""), str(exc)
        return transport, ""

    async def _fetch_chunks(self, ctx: ActorContext, peer: str, relative: str, part: parts.PartFile) -> None:
        """The rest of the file from `peer` over NATS, `window` chunk requests in flight, each checked and written
        in order (`_land`: one worker-thread hop a chunk while the others travel)."""
        subject = ctx.subjects.files(peer, "chunk")
        plan = iter(transfer.chunk_plan(part.size, part.chunk, part.received))
        try:
            async with asyncio.TaskGroup() as tg:
                pending: deque[tuple[int, int, asyncio.Task[Msg | BaseException]]] = deque()

                def ask(offset: int, length: int) -> None:
                    request = ChunkRequest(path=relative, blake3=part.digest, offset=offset, length=length)
                    pending.append((offset, length, tg.create_task(self._request_chunk(ctx, subject, request))))

                for offset, length in itertools.islice(plan, self.limits.window):
                    ask(offset, length)
                while pending:
                    offset, length, task = pending.popleft()
                    data, headers = _chunk(subject, await task)
                    refusal = await self._blocking(_land, part, offset, length, data, headers)
                    if refusal is not None:
                        raise _Refused(refusal)
                    following = next(plan, None)
                    if following is not None:
                        ask(*following)
        except BaseExceptionGroup as group:
            raise _first(group) from None


def _land(
    part: parts.PartFile, offset: int, length: int, data: bytes, headers: dict[str, str]
) -> TransferRefusal | None:
    """A chunk reply checked against what was asked and the blake3 stated with it, then written (worker
    thread): hashing, checking and writing a chunk cost one hop."""
    stated = headers.get(FILES_BLAKE3_HEADER, "")
    refusal = transfer.check_chunk(
        offset=offset,
        length=length,
        total=part.size,
        got_offset=_int(headers.get(FILES_OFFSET_HEADER)),
        got_total=_int(headers.get(FILES_TOTAL_HEADER)),
        got_length=len(data),
        stated=stated,
        observed=_hash(data),
    )
    if refusal is None:
        part.write(offset, data, stated)
    return refusal


def _version(digests: FileDigests, path: Path) -> tuple[FileKey, str]:
    """The file's current version and its blake3 (worker thread; hashed once per version)."""
    fd, key = open_regular(path)
    try:
        return key, digests.digest_open(fd, key, path)
    finally:
        os.close(fd)


def _open_version(path: Path, key: FileKey) -> BinaryIO:
    """The file, opened only while it is the version `key` (worker thread)."""
    fd, now = open_regular(path)
    if now != key:
        os.close(fd)
        raise OSError(f"{path.name} changed since its ticket was issued")
    return os.fdopen(fd, "rb")


def _version_reader(path: Path, key: FileKey) -> ChunkReader:
    """Chunks of that version of the file and their blake3 (the listener's worker threads): a file rewritten,
    replaced or touched since the ticket was issued ends the stream (the fetcher resumes over NATS, where the
    other version is refused)."""

    def read(offset: int, length: int) -> tuple[bytes, bytes]:
        fd, now = open_regular(path)
        try:
            if now != key:
                raise OSError(f"{path.name} changed since its ticket was issued")
            data = os.pread(fd, length, offset)
            while len(data) < length:
                more = os.pread(fd, length - len(data), offset + len(data))
                if not more:
                    break
                data += more
        finally:
            os.close(fd)
        return data, blake3.blake3(data).digest()

    return read


def _hash(data: bytes) -> str:
    return str(blake3.blake3(data).hexdigest())


def _header_facts(path: Path) -> tuple[int, ModelGeometry]:
    """The file's size and its header's facts (worker thread; a FIFO or device is refused unopened)."""
    fd, key = open_regular(path)
    with os.fdopen(fd, "rb") as handle:
        return key.size, geometry_from_header(parse_header(handle, key.size, source=path.name))


def _read_hashed(digests: FileDigests, path: Path, offset: int, length: int) -> tuple[str, bytes, int, str]:
    """The file's blake3 (cached per version), a chunk of it, its size and the chunk's blake3, in one
    worker-thread hop and from one descriptor (the chunk is of the version the digest is of). The chunk is
    read straight into the bytes that are sent (pread(2)), not into a buffer then copied."""
    fd, key = open_regular(path)
    try:
        digest = digests.digest_open(fd, key, path)
        want = max(0, min(length, key.size - offset))
        data = os.pread(fd, want, offset)
        while len(data) < want:  # a short read (a signal, or the file shrank under us: the fetcher refuses it)
            more = os.pread(fd, want - len(data), offset + len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    return digest, data, key.size, _hash(data)


def _int(value: str | None) -> int:
    try:
        return int(value) if value is not None else -1
    except ValueError:
        return -1


def _chunk(subject: str, reply: Msg | BaseException) -> tuple[bytes, dict[str, str]]:
    """A chunk reply's bytes and headers; an error reply or a lost peer is `_PeerFailed`."""
    if isinstance(reply, BaseException):
        raise _PeerFailed(str(reply))
    headers = reply.headers or {}
    if ERROR_HEADER in headers or MESH_ERROR_HEADER in headers:
        try:
            parse_reply(subject, reply, bytes)
        except BusError as exc:
            raise _PeerFailed(str(exc)) from exc
    return reply.data, dict(headers)


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first error inside (nested) exception groups."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
