"""Model facts for placement (shell): the geometry of the model a request names, from its file or from a
signed registry entry.

Model names come from clients, so they are hostile input. Every file operation runs in a worker thread,
through `runtime.model_files`: a name with a NUL byte or 200 KB long, a FIFO, a device or a directory is a
`model_unreadable` refusal, never an exception and never a blocked event loop; a relative name is a file
inside the node's models dir (as the runner resolves it), and may not climb out of it; an absolute one must be
in one of the node's model directories (`roots`) when the node has them. No refusal echoes a file's bytes: a
file that is not a GGUF header this reader accepts is named with where the problem is, and the problem itself
(which may quote the file) goes to the node's log. Header facts are cached per file version (device, inode,
size, mtime); registry files are hashed once per version. A model's companion files (a draft model, a
multimodal projector) are read by the same rules, and hashed (once per version) so that the stamp names the
very file admission sized; a refusal names the companion (`draft: …`, `mmproj: …`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import nats.js.errors
from nats.js.kv import KeyValue

from actors.placement.admission import ModelFacts
from actors.placement.geometry import GeometryError, UnsupportedArchitecture, geometry_from_header
from actors.placement.gguf_header import GGUFFormatError, GGUFHeader, parse_header
from actors.placement.projector import ProjectorError, UnsupportedProjector, projector_from_header
from actors.placement.registry import RegistryUntrusted, check_file, verify
from messages.model import ModelGeometry, ProjectorGeometry
from messages.placement import Companion, ModelRef, RejectReason
from messages.registry import RegistryEntry
from runtime.bus import BadMessage, decode_checked
from runtime.logging import get_logger
from runtime.model_files import FileDigests, FileKey, ModelFileError, check_name, file_key, open_regular, resolve

#: KV key characters (nats-py refuses others); a registry name outside them names no entry.
_REGISTRY_NAME = re.compile(r"^[-/_=.a-zA-Z0-9]{1,255}$")
_CACHE_ENTRIES = 256

_Facts = TypeVar("_Facts", ModelGeometry, ProjectorGeometry)


class ModelProblem(Exception):
    """The model cannot be placed; `reason` is the decision's reject reason."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Cached:
    key: FileKey
    geometry: ModelGeometry


class ModelReader:
    """Reads what admission needs about a model. Thread-safe: header reads and hashing run in workers."""

    def __init__(
        self,
        *,
        trusted_registry_keys: tuple[str, ...] = (),
        models_dir: Path | None = None,
        digests: FileDigests | None = None,
        roots: tuple[Path, ...] | None = None,
    ) -> None:
        """`roots`: directories model files may be in besides `models_dir`; None: an absolute path may be
        anywhere (for tests and embedding; `mesh-actor run` always gives the node's directories)."""
        self.trusted = trusted_registry_keys
        self.models_dir = models_dir
        self.roots = None if roots is None else ((models_dir,) if models_dir else ()) + roots
        self._log = get_logger(component="model_reader")
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._lock = threading.Lock()
        self._digests = digests or FileDigests()

    async def facts(
        self, ref: ModelRef, registry: KeyValue, *, peers: Callable[[str], Awaitable[ModelFacts | None]] | None = None
    ) -> ModelFacts:
        """The model a request names, read here or taken from its signed registry entry; with `peers`, a file
        named relative to the models dir that is not here is read by the nodes that hold it (their header facts
        and blake3: the node that runs it fetches it at that digest)."""
        if ref.path is None and ref.registry is None:
            raise ModelProblem("model_unreadable", "the request names no model: give model.path or model.registry")
        if ref.registry is not None:
            facts = await self._registry_facts(registry, ref.registry, ref.path)
        else:
            assert ref.path is not None
            held = None
            if peers is not None and await asyncio.to_thread(self._missing_here, ref.path):
                held = await peers(ref.path)
            if held is None:
                geometry = await asyncio.to_thread(self.load_geometry, ref.path)
                held = ModelFacts(geometry=geometry, path=ref.path)
            facts = held
        if ref.draft is not None:
            draft, digest = await asyncio.to_thread(self._companion, ref.draft, "draft", self.load_geometry)
            facts = dataclasses.replace(facts, draft=draft, draft_file=Companion(path=ref.draft, digest=digest))
        if ref.mmproj is not None:
            projector, digest = await asyncio.to_thread(self._companion, ref.mmproj, "mmproj", self.load_projector)
            mmproj = Companion(path=ref.mmproj, digest=digest)
            facts = dataclasses.replace(facts, projector=projector, projector_file=mmproj)
        return facts

    def _companion(self, path: str, role: str, load: Callable[[str], _Facts]) -> tuple[_Facts, str]:
        """A companion file's header facts and blake3 (blocking: worker thread); refusals name its role."""
        try:
            facts = load(path)
            return facts, self._digests.digest(self._resolve(path))
        except ModelProblem as exc:
            raise ModelProblem(exc.reason, f"{role}: {exc}") from exc
        except ModelFileError as exc:
            raise ModelProblem("model_unreadable", f"{role}: {exc}") from exc

    def _missing_here(self, path: str) -> bool:
        """Whether `path` is a relative name inside the models dir with no file there (blocking: worker thread;
        a bad name is not "missing": reading it says what is wrong)."""
        if self.models_dir is None or path.startswith("/"):
            return False
        try:
            return not os.path.lexists(self._resolve(path))
        except ModelProblem:
            return False

    def _resolve(self, path: str) -> Path:
        """The file `path` names here (blocking: worker thread). Relative paths live in the models dir."""
        try:
            check_name(path)
            if self.models_dir is None and not Path(path).is_absolute():
                raise ModelFileError(
                    f"{path!r} is a relative path and this placement node has no models dir: give an absolute path"
                )
            return resolve(path, self.models_dir or Path("."), roots=self.roots)
        except ModelFileError as exc:
            raise ModelProblem("model_unreadable", str(exc)) from exc

    def load_geometry(self, path: str) -> ModelGeometry:
        """Header facts of a local file (blocking: worker thread), cached per file version."""
        resolved = self._resolve(path)
        try:
            fd, key = open_regular(resolved)
            with os.fdopen(fd, "rb") as handle:
                with self._lock:
                    cached = self._cache.get(str(resolved))
                if cached is not None and cached.key == key:
                    return cached.geometry
                geometry = geometry_from_header(parse_header(handle, key.size, source=str(resolved)))
        except (ModelFileError, UnsupportedArchitecture, GGUFFormatError, GeometryError, OSError) as exc:
            raise self._problem(path, resolved, exc) from exc
        with self._lock:
            self._cache[str(resolved)] = _Cached(key=key, geometry=geometry)
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return geometry

    def load_projector(self, path: str) -> ProjectorGeometry:
        """A multimodal projector's facts (blocking: worker thread). Its header is small (no vocabulary), so
        it is read again each time rather than cached; its digest is cached per file version."""
        resolved = self._resolve(path)
        try:
            fd, key = open_regular(resolved)
            with os.fdopen(fd, "rb") as handle:
                header: GGUFHeader = parse_header(handle, key.size, source=str(resolved))
            return projector_from_header(header)
        except UnsupportedProjector as exc:
            raise ModelProblem("unsupported_architecture", f"{path}: {exc}") from exc
        except ProjectorError as exc:
            raise ModelProblem("model_unreadable", f"{path}: {exc}") from exc
        except (ModelFileError, GGUFFormatError, OSError) as exc:
            raise self._problem(path, resolved, exc) from exc

    def _problem(self, path: str, resolved: Path, exc: Exception) -> ModelProblem:
        """The refusal for a file that could not be read as a model. A header's problem may quote the file (a
        bad magic is the file's first bytes): it is logged here, not answered."""
        if isinstance(exc, ModelFileError):
            return ModelProblem("model_unreadable", str(exc))
        if isinstance(exc, UnsupportedArchitecture):
            return ModelProblem("unsupported_architecture", str(exc))
        if isinstance(exc, GGUFFormatError):
            self._log.info("model_not_gguf", path=str(resolved), offset=exc.offset, problem=exc.problem)
            return ModelProblem(
                "model_unreadable", f"{path} is not a GGUF file this node can read (a problem at byte {exc.offset})"
            )
        if isinstance(exc, GeometryError):
            return ModelProblem("model_unreadable", f"{path}: {exc}")
        if isinstance(exc, OSError):
            return ModelProblem("model_unreadable", f"cannot read {path}: {exc.strerror or exc}")
        return ModelProblem("model_unreadable", f"cannot read {path}: {exc}")

    async def _registry_facts(self, registry: KeyValue, name: str, path: str | None) -> ModelFacts:
        if not _REGISTRY_NAME.match(name):
            raise ModelProblem("model_unreadable", f"{name[:80]!r} is not a registry entry name")
        try:
            entry_raw = await registry.get(name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyValueError, ValueError) as exc:
            raise ModelProblem("model_unreadable", f"no registry entry named {name!r}") from exc
        if not entry_raw.value:
            raise ModelProblem("model_unreadable", f"no registry entry named {name!r}")
        try:
            entry = decode_checked(entry_raw.value, RegistryEntry, f"registry entry {name!r}")
            verify(entry, self.trusted, stored_as=name)
            if path is not None:
                await asyncio.to_thread(self._check_registry_file, entry, path)
        except (BadMessage, RegistryUntrusted) as exc:
            raise ModelProblem("registry_untrusted", str(exc)) from exc
        return ModelFacts(geometry=entry.geometry, path=path or entry.file_name, digest=entry.blake3)

    def _check_registry_file(self, entry: RegistryEntry, path: str) -> None:
        """When the placement node has the file, it must be the one that was signed: size, then blake3
        (blocking: worker thread; each file version is hashed once)."""
        resolved = self._resolve(path)
        if not os.path.lexists(resolved):
            return  # not on this node: the signed facts are enough
        try:
            size = file_key(resolved).size
            check_file(entry, size=size, digest=None)  # cheap check before hashing
            check_file(entry, size=size, digest=self._digests.digest(resolved))
        except ModelFileError as exc:
            raise ModelProblem("model_unreadable", str(exc)) from exc
