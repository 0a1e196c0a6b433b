"""The model catalog: `models.toml` in the data dir (front-door core, pure).

```toml
[models.qwen-0_5b]
path = "qwen2.5-0.5b-instruct-q4_k_m.gguf"   # a file (relative: in the models dir) or a registry entry name
ctx = 8192                                  # -c for its instances (default: 4096)
parallel = 4                                # -np for its instances (within the node's bounds)
pinned = true                               # never stopped to make room
priority = 10                               # higher stays longer when memory is short
idle_ttl_s = 600                            # stopped after this long without a request
min_replicas = 1                            # instances always kept running (restarted when they end)
max_replicas = 3                            # instances the load may add (default 1: one instance)
target_wait_s = 5                           # add one while a request would wait longer than this for a slot
replica_idle_s = 120                        # retire an added one after this long without work
max_queue = 32                              # requests waiting for an instance (beyond: 429)
cache_type_k = "q8_0"                       # -ctk its instances need
cache_type_v = "q8_0"                       # -ctv (a quantized V cache needs flash_attn "on")
flash_attn = "on"                           # -fa
spec_type = "draft-mtp"                     # --spec-type (speculation)
spec_draft_n_max = 3                        # --spec-draft-n-max

[models.qwen-7b]
path = "qwen2.5-7b-instruct-q4_k_m.gguf"
draft = "qwen2.5-0.5b-instruct-q4_k_m.gguf"  # --model-draft (same vocabulary); spec_type "draft-simple"

[models.llava]
path = "llava-v1.5-7b-q4_k_m.gguf"
mmproj = "llava-v1.5-7b-mmproj-f16.gguf"     # --mmproj: image parts in chat bodies (a LLaVA "mlp" projector)

[models.embed]
path = "qwen3-embedding-0.6b-q8_0.gguf"
kind = "embedding"                          # --embeddings (default: what the header's pooling type says)
pooling = "last"                            # --pooling (default: the header's, else mean)

[models.rerank]
path = "qwen3-reranker-0.6b-q8_0.gguf"
kind = "rerank"                             # --rerank: /v1/rerank (the model needs a classification head)
```

Names are what `/v1/models` lists and what requests name (`model`); each is one subject-safe token. Every
value is validated here; an error names the model and the field.

Serving settings (`parallel`, the cache types, flash attention, speculation, `kind` and `pooling`) are the
model's own: they travel in the placement request (`PreferredSettings`), a node accepts them within its bounds
(else `settings_mismatch`, the bound named), and the instance runs with exactly them (its stamp). An instance
of the same file with other settings is not used. Without `kind`, the model's header decides: a pooling type
makes an embedding model, rank pooling a reranker, none a generation model. An embedding or rerank model's
batch holds a whole input (admission sizes that batch), and its answers are never captured into L3.

Companion files (`draft`, `mmproj`) are named like `path` and travel in the placement request's model
(`model_ref`); admission sizes each from its own header and stamps it with its digest, and an instance runs
the model only with exactly these companions (`runs_on` given its stamp). A `draft` without `spec_type`
speculates with it ("draft-simple"), the one speculation type a draft model serves here. A projector is sized
for the types the memory model knows (LLaVA's "mlp"); placement refuses one it does not size
(`unsupported_architecture`, naming mmproj) rather than ignore it.
"""

from __future__ import annotations

import tomllib
from typing import Annotated, Final, Literal

import msgspec

from actors.placement.context import CACHE_TYPES, DRAFT_SIMPLE, SPEC_TYPES
from messages.placement import Companion, ModelRef, PreferredSettings, Stamp
from messages.settings import CacheType, Pooling, ServingKind, ServingSettings
from messages.subjects import check_token

__all__ = ["CATALOG_FILE", "Catalog", "CatalogError", "CatalogModel", "parse_catalog"]

CATALOG_FILE: Final = "models.toml"


class CatalogError(ValueError):
    """The catalog cannot be used; the message names the file, the model and the field."""


class CatalogModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    registry: bool = False  # `path` names a signed registry entry instead of a file
    ctx: Annotated[int, msgspec.Meta(ge=16, le=1 << 24)] = 4096
    parallel: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    pinned: bool = False
    priority: int = 0
    idle_ttl_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    max_queue: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 64
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 600.0  # a request's whole life, load included
    cache_type_k: CacheType | None = None
    cache_type_v: CacheType | None = None
    flash_attn: Literal["on", "off"] | None = None
    spec_type: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    spec_draft_n_max: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    kind: ServingKind | None = None  # None: what the model's header says (its pooling type)
    pooling: Pooling | None = None  # an embedding or rerank model's (None: the header's, else mean)
    draft: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None  # --model-draft
    mmproj: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None  # --mmproj
    # Replicas (`scaling`): how many instances, and when the load adds or retires one.
    min_replicas: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    max_replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    target_wait_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    replica_idle_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 120.0

    def required_settings(self) -> PreferredSettings | None:
        """What its instances must run with (None: whatever the node advertises)."""
        settings = PreferredSettings(
            slots=self.parallel,
            cache_type_k=self.cache_type_k,
            cache_type_v=self.cache_type_v,
            flash_attn=self.flash_attn,
            spec_type=self.spec_type or (DRAFT_SIMPLE if self.draft else None),
            spec_draft_n_max=self.spec_draft_n_max,
            kind=self.kind,
            pooling=self.pooling,
        )
        return None if settings == PreferredSettings() else settings

    def served_as(self, kind: ServingKind | None) -> PreferredSettings | None:
        """What an instance must run to serve this model: its required settings, with `kind` (the entry's own,
        or its header's as the front door read it) in place of an unnamed one; None: anything."""
        required = self.required_settings()
        if kind is None or (required is not None and required.kind is not None):
            return required
        return msgspec.structs.replace(required or PreferredSettings(), kind=kind)

    def model_ref(self, path: str | None = None) -> ModelRef:
        """The model a placement request names: the file (`path` as the front door resolved it, else the name
        given here) or the registry entry, with its companion files as named here (a relative name is found in
        the placing node's models dir, as `path` is)."""
        if self.registry:
            return ModelRef(registry=self.path, draft=self.draft, mmproj=self.mmproj)
        return ModelRef(path=path or self.path, draft=self.draft, mmproj=self.mmproj)

    def runs_on(self, settings: ServingSettings | Stamp, kind: ServingKind | None = None) -> bool:
        """Whether an instance running with `settings` meets this model's requirements (`served_as(kind)`);
        given its whole stamp, also whether it runs exactly this model's companion files (an instance of the
        same file with another draft, or none, serves another model)."""
        if isinstance(settings, Stamp):
            if not (_is(settings.draft, self.draft) and _is(settings.mmproj, self.mmproj)):
                return False
            settings = settings.settings
        required = self.served_as(kind)
        return required is None or required.met_by(settings)

    def check(self) -> None:
        """Refuses combinations llama-server would refuse (ValueError naming the fields)."""
        if self.spec_type is not None:
            unknown = [p.strip() for p in self.spec_type.split(",") if p.strip() not in SPEC_TYPES]
            if unknown:
                raise ValueError(
                    f"spec_type: unknown speculative type {unknown[0]!r} (accepted: {', '.join(sorted(SPEC_TYPES))})"
                )
        v = self.cache_type_v
        if self.flash_attn == "off" and v is not None and CACHE_TYPES[v][0] > 1:
            raise ValueError(f'cache_type_v: a quantized V cache ({v}) needs flash_attn = "on"')
        if self.pooling is not None and self.kind == "generate":
            raise ValueError(f'pooling: a generation model (kind = "generate") does not pool ("{self.pooling}")')
        if self.kind == "rerank" and self.pooling not in (None, "rank"):
            raise ValueError(f'pooling: a reranker pools by rank, not "{self.pooling}"')
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: {self.min_replicas} is over max_replicas ({self.max_replicas})")
        if self.draft is not None and self.spec_type not in (None, DRAFT_SIMPLE):
            raise ValueError(
                f'draft: a draft model speculates with spec_type = "{DRAFT_SIMPLE}", not "{self.spec_type}"'
            )


def _is(stamped: Companion | None, named: str | None) -> bool:
    """Whether the companion an instance was stamped with is the file named in the catalog: the same name, or
    the file a relative name resolves to (the runner stamps the path it resolved inside its models dir)."""
    if stamped is None or named is None:
        return stamped is None and named is None
    if stamped.path == named:
        return True
    parts = [part for part in named.split("/") if part not in ("", ".")]
    return not named.startswith("/") and bool(parts) and stamped.path.split("/")[-len(parts) :] == parts


class Catalog(msgspec.Struct, frozen=True, kw_only=True):
    models: dict[str, CatalogModel]

    def get(self, name: str) -> CatalogModel | None:
        return self.models.get(name)


def parse_catalog(text: str, source: str = CATALOG_FILE) -> Catalog:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{source}: not TOML: {exc}") from exc
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise CatalogError(f"{source}: unknown table or key {unknown[0]!r} (only [models.NAME] tables)")
    tables = data.get("models", {})
    if not isinstance(tables, dict):
        raise CatalogError(f"{source}: `models` must be a table of [models.NAME] tables")
    models = {}
    for name, table in tables.items():
        try:
            check_token(name, "model name")
        except ValueError as exc:
            raise CatalogError(f"{source}: {exc}") from exc
        if not isinstance(table, dict):
            raise CatalogError(f"{source}: [models.{name}] must be a table")
        try:
            models[name] = msgspec.convert(table, CatalogModel)
            models[name].check()
        except (msgspec.ValidationError, ValueError) as exc:
            raise CatalogError(f"{source}: [models.{name}]: {exc}") from exc
    return Catalog(models=models)
