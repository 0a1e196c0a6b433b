"""Node configuration: flags > environment (`MESH_ACTOR_*`) > `config.toml` in the data dir > defaults.

The data dir itself comes from `--data-dir`, else `MESH_ACTOR_HOME`, else `~/.local/share/mesh-actor`.
Serving settings (what this node advertises and runs llama-server with) live in the `[serving]` table of
the TOML file, in `MESH_ACTOR_SERVING_<FIELD>` variables, or in llama-server-named flags of `mesh-actor run`.
The bounds of a model's own settings live in the `[bounds]` table, `MESH_ACTOR_BOUNDS_<FIELD>` variables
(lists comma-separated) or `--max-slots`/`--allow-*` flags.
Every value is validated once, here; an invalid one is a `ConfigError` naming its source.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from messages.settings import ServingSettings, SettingsBounds
from messages.subjects import DEFAULT_PREFIX, Subjects, check_token
from runtime.sizes import parse_size

ENV_PREFIX = "MESH_ACTOR_"
CONFIG_FILE = "config.toml"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names where it came from."""


@dataclass(frozen=True, slots=True)
class NatsOptions:
    """How to reach NATS. No URLs means: start the embedded server."""

    urls: tuple[str, ...] = ()
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class NodeConfig:
    data_dir: Path
    node_id: str
    prefix: str = DEFAULT_PREFIX
    nats: NatsOptions = field(default_factory=NatsOptions)
    nats_port: int = 4222  # preferred port of the embedded server; a free one is used if taken
    nats_host: str = "127.0.0.1"  # where the embedded server listens; beyond loopback it requires TLS
    memory_limit_bytes: int | None = None
    telemetry_interval_s: float = 5.0
    telemetry_ttl_s: float = 15.0
    llama_server: str | None = None  # path override; default: the one the `llama` extra installed
    models_dir: Path | None = None  # where relative model paths (registry entries) are found; default data_dir/models
    model_roots: tuple[Path, ...] = ()  # where else model files may be (placement refuses paths outside them all)
    serving: ServingSettings = field(default_factory=ServingSettings)
    bounds: SettingsBounds = field(default_factory=SettingsBounds)
    registry_keys: tuple[str, ...] = ()  # nkey public keys whose registry entries placement trusts
    journal_max_age_s: float = 7 * 24 * 3600.0
    journal_max_bytes: int = 1 << 30
    log_level: str = "info"
    l3_budget_bytes: int | None = None  # None: a capped share of the disk (actors/l3/budget.py); 0: no capture
    http: tuple[str, int] | None = None  # the OpenAI-compatible front door's address (None: no front door)
    api_key: str | None = None  # the bearer key the front door requires (required beyond loopback)
    metrics: tuple[str, int] | None = None  # a listener of its own for GET /metrics (None: only the front door's)
    cluster_listen: tuple[str, int] | None = None  # the embedded server's route listener (None: no cluster)
    cluster_routes: tuple[str, ...] = ()  # HOST:PORT of other servers' route listeners (--join)
    cluster_secret: str | None = None  # the route password every server of the cluster shares
    health_probe_interval_s: float = 30.0  # a ready, idle server with no successful completion this long is probed
    health_probe_timeout_s: float = 30.0  # a probe (one token) must answer within this
    frontdoor_grouping: bool = True  # group a model's requests while a swap is pending (off: arrival order)
    otlp: str | None = None  # an OTLP/HTTP collector each hop's span is exported to (None: nothing exported)
    metrics_on: bool = True  # fold and serve the node's metrics where a listener serves them (--no-metrics: not)
    trace_on: bool = True  # carry requests' trace context (off only for benchmarks/observability_overhead.py)
    max_hold_s: float = 3600.0  # the longest unclaimed hold placement grants a request (longer: hold_too_long)
    client_share: float = 0.5  # of each node's devices, what one client may hold booked at once
    clients_share: float = 0.5  # of each node's devices, what every client together may hold booked at once
    # Split serving: whether this node lends its host memory to other nodes' splits (it needs the cluster
    # secret's certificates and ggml-rpc-server), and the address those nodes reach it on (default: the
    # cluster listener's host; a wildcard listener advertises the host's name).
    lend: bool = True
    lend_host: str | None = None
    # Bulk bytes (model files, L3 segments, handoffs) on a direct stream beside the bus (docs/datapath.md); False:
    # every byte over NATS, as to a firewalled peer (this node neither offers nor dials the direct path).
    direct_path: bool = True

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)


def default_data_dir(env: Mapping[str, str]) -> Path:
    home = env.get("MESH_ACTOR_HOME")
    return Path(home) if home else Path.home() / ".local" / "share" / "mesh-actor"


def _positive_float(text: Any) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text!r} is not a positive number")
    return value


def _share(text: Any) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(f"{text!r} is not a share in (0, 1]")
    return value


def _bool(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (true or false)")


def _port(text: Any) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"{text!r} is not a TCP port")
    return value


def _size(text: Any) -> int:
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    return parse_size(str(text))


def _budget(text: Any) -> int:
    """A size, where 0 is allowed (it turns the L3 store's capture off)."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    return 0 if str(text).strip() in ("0", "0B", "0b") else parse_size(str(text))


def _http(text: Any) -> tuple[str, int]:
    """`HOST:PORT`, or a bare `PORT` (loopback)."""
    value = str(text).strip()
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    number = int(port)
    if not 0 <= number < 65536:
        raise ValueError(f"{value!r}: the port must be 0-65535")
    return host, number


def _otlp(text: Any) -> str:
    """An OTLP/HTTP collector's URL: its base (`http://HOST:4318`) or its traces endpoint (`.../v1/traces`)."""
    value = str(text).strip()
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{value!r} is not an http(s) URL of an OTLP collector (e.g. http://127.0.0.1:4318)")
    return value


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface: `localhost`, or an address in 127.0.0.0/8 or
    ::1 (a name that merely begins with "127." is any host)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(text: Any) -> tuple[str, int | None]:
    """`HOST:PORT` or `HOST` (the port then comes from --nats-port) where the embedded server listens."""
    value = str(text).strip()
    host, colon, port = value.rpartition(":")
    if not colon or "]" in port:  # no port (an IPv6 address in brackets has colons of its own)
        host, port = value, ""
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{value!r} names no host (e.g. 0.0.0.0:4222)")
    return host, _port(port) if port else None


def _address(text: Any) -> tuple[str, int]:
    """`HOST:PORT` (both required)."""
    value = str(text).strip().removeprefix("nats://")
    host, colon, port = value.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port:
        raise ValueError(f"{value!r} is not HOST:PORT")
    number = _port(port)
    if number == 0:
        raise ValueError(f"{value!r}: the port must not be 0")
    return host, number


def _routes(text: Any) -> tuple[str, ...]:
    items = text if isinstance(text, list | tuple) else str(text).split(",")
    routes = []
    for item in items:
        if str(item).strip():
            host, port = _address(item)
            routes.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return tuple(dict.fromkeys(routes))


def _urls(text: Any) -> tuple[str, ...]:
    items = text if isinstance(text, list | tuple) else str(text).split(",")
    urls = tuple(str(u).strip() for u in items if str(u).strip())
    for url in urls:
        if "://" not in url:
            raise ValueError(f"{url!r} is not a URL (expected e.g. nats://host:4222)")
    return urls


def _keys(text: Any) -> tuple[str, ...]:
    items = text if isinstance(text, list | tuple) else str(text).split(",")
    return tuple(str(k).strip() for k in items if str(k).strip())


def _node_id(text: Any) -> str:
    return check_token(str(text), "node id")


def _prefix(text: Any) -> str:
    return Subjects(str(text)).prefix


def _level(text: Any) -> str:
    value = str(text).lower()
    if value not in ("debug", "info", "warning", "error"):
        raise ValueError(f"{text!r} is not a log level (debug, info, warning, error)")
    return value


# Scalar options: name -> parser. The flag is --name-with-dashes, the variable MESH_ACTOR_NAME, the TOML
# key `name` (top level), and NATS options also under a `[nats]` table without the `nats_` prefix.
_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "node_id": _node_id,
    "prefix": _prefix,
    "nats_port": _port,
    "nats_listen": _listen,
    "memory_limit": _size,
    "telemetry_interval": _positive_float,
    "telemetry_ttl": _positive_float,
    "llama_server": str,
    "registry_keys": _keys,
    "models_dir": str,
    "model_roots": _keys,
    "journal_max_age": _positive_float,
    "journal_max_bytes": _size,
    "log_level": _level,
    "l3_budget": _budget,
    "http": _http,
    "metrics": _http,
    "api_key": str,
    "api_key_file": str,
    "cluster_listen": _address,
    "join": _routes,
    "cluster_secret": str,
    "cluster_secret_file": str,
    "health_probe_interval": _positive_float,
    "health_probe_timeout": _positive_float,
    "frontdoor_grouping": _bool,
    "otlp": _otlp,
    "metrics_on": _bool,
    "trace_on": _bool,
    "max_hold": _positive_float,
    "client_share": _share,
    "clients_share": _share,
    "lend": _bool,
    "lend_host": str,
    "direct_path": _bool,
    "nats": _urls,
    "nats_user": str,
    "nats_password": str,
    "nats_password_file": str,
    "nats_token": str,
    "nats_creds": str,
    "nats_tls_ca": str,
    "nats_tls_cert": str,
    "nats_tls_key": str,
}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    nats_table = data.get("nats")
    if isinstance(nats_table, dict):  # [nats] urls = [...], user = ... (a top-level `nats = "url"` also works)
        del data["nats"]
        for key, value in nats_table.items():
            name = "nats" if key == "urls" else f"nats_{key}"
            if name not in _OPTIONS:
                raise ConfigError(f"{path}: unknown key {key!r} in [nats]")
            data[name] = value
    unknown = sorted(set(data) - set(_OPTIONS) - {"serving", "bounds"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}")
    return data


def read_secret_file(path: str, what: str) -> str:
    """A secret kept in a file (its first line), so it never appears in a process's argv."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc}") from exc
    secret = text.splitlines()[0] if text else ""
    if not secret:
        raise ConfigError(f"the {what} file {path} is empty")
    return secret


def read_password_file(path: str) -> str:
    """The NATS password kept in a file (its first line)."""
    return read_secret_file(path, "NATS password")


def _password(values: Mapping[str, Any]) -> str | None:
    password, path = values.get("nats_password"), values.get("nats_password_file")
    if path is None:
        return password if password is None else str(password)
    if password is not None:
        raise ConfigError("give the NATS password once: a password file or MESH_ACTOR_NATS_PASSWORD, not both")
    return read_password_file(str(path))


def _cluster_secret(values: Mapping[str, Any]) -> str | None:
    secret, path = values.get("cluster_secret"), values.get("cluster_secret_file")
    if path is not None:
        if secret is not None:
            raise ConfigError("give the cluster secret once: --cluster-secret-file or MESH_ACTOR_CLUSTER_SECRET")
        try:
            text = Path(str(path)).read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the cluster secret file {path}: {exc}") from exc
        secret = text.splitlines()[0].strip() if text.strip() else ""
    if secret is None:
        return None
    secret = str(secret)
    if len(secret) < 16:
        raise ConfigError("the cluster secret must be at least 16 characters (e.g. `openssl rand -hex 24`)")
    return secret


def _cluster(values: Mapping[str, Any]) -> tuple[tuple[str, int] | None, tuple[str, ...], str | None]:
    listen: tuple[str, int] | None = values.get("cluster_listen")
    routes: tuple[str, ...] = values.get("join", ())
    secret = _cluster_secret(values)
    if listen is None:
        if routes:
            raise ConfigError("--join needs --cluster-listen HOST:PORT (where this node's server takes routes)")
        return None, (), None
    if values.get("nats"):
        raise ConfigError("--cluster-listen clusters the embedded NATS server: it cannot be given with --nats")
    if secret is None and not is_loopback(listen[0]):
        raise ConfigError(
            f"the cluster listens on {listen[0]}, beyond loopback: give the route secret every node shares "
            "(--cluster-secret-file FILE or MESH_ACTOR_CLUSTER_SECRET)"
        )
    return listen, routes, secret


def load_config(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    serving_flags: Mapping[str, Any] | None = None,
    bounds_flags: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Builds the node configuration. `flags` maps option names to values (None = not given)."""
    env = os.environ if env is None else env
    data_dir = Path(flags["data_dir"]) if flags.get("data_dir") else default_data_dir(env)
    toml_path = data_dir / CONFIG_FILE
    file_values = _read_toml(toml_path)

    values: dict[str, Any] = {}
    for name, parse in _OPTIONS.items():
        for source, raw in (
            (f"--{name.replace('_', '-')}", flags.get(name)),
            (f"{ENV_PREFIX}{name.upper()}", env.get(f"{ENV_PREFIX}{name.upper()}")),
            (f"{toml_path} key {name!r}", file_values.get(name)),
        ):
            if raw is not None:
                try:
                    values[name] = parse(raw)
                except (ValueError, TypeError) as exc:
                    raise ConfigError(f"{source}: {exc}") from exc
                break

    l3_on = values.get("l3_budget") != 0
    serving = _serving_settings(file_values.get("serving"), env, serving_flags or {}, toml_path, l3_on=l3_on)
    bounds = _settings_bounds(file_values.get("bounds"), env, bounds_flags or {}, toml_path)
    nats = NatsOptions(
        urls=values.get("nats", ()),
        user=values.get("nats_user"),
        password=_password(values),
        token=values.get("nats_token"),
        creds_file=values.get("nats_creds"),
        tls_ca=values.get("nats_tls_ca"),
        tls_cert=values.get("nats_tls_cert"),
        tls_key=values.get("nats_tls_key"),
    )
    listen_host, listen_port = values.get("nats_listen", ("127.0.0.1", None))
    cluster_listen, cluster_routes, cluster_secret = _cluster(values)
    if values.get("metrics") is not None and not values.get("metrics_on", True):
        raise ConfigError("--metrics serves the node's metrics: it cannot be given with --no-metrics")
    interval = values.get("telemetry_interval", 5.0)
    ttl = values.get("telemetry_ttl", max(15.0, 3 * interval))
    if ttl <= interval:
        raise ConfigError(f"telemetry ttl ({ttl}s) must be longer than the interval ({interval}s)")
    return NodeConfig(
        data_dir=data_dir,
        node_id=values.get("node_id") or _node_id(default_node_id()),
        prefix=values.get("prefix", DEFAULT_PREFIX),
        nats=nats,
        nats_port=listen_port if listen_port is not None else values.get("nats_port", 4222),
        nats_host=listen_host,
        memory_limit_bytes=values.get("memory_limit"),
        telemetry_interval_s=interval,
        telemetry_ttl_s=ttl,
        llama_server=values.get("llama_server"),
        registry_keys=values.get("registry_keys", ()),
        models_dir=Path(values["models_dir"]) if values.get("models_dir") else None,
        model_roots=tuple(Path(p) for p in values.get("model_roots", ())),
        serving=serving,
        bounds=bounds,
        journal_max_age_s=values.get("journal_max_age", 7 * 24 * 3600.0),
        journal_max_bytes=values.get("journal_max_bytes", 1 << 30),
        log_level=values.get("log_level", "info"),
        l3_budget_bytes=values.get("l3_budget"),
        http=values.get("http"),
        metrics=values.get("metrics"),
        api_key=_api_key(values),
        cluster_listen=cluster_listen,
        cluster_routes=cluster_routes,
        cluster_secret=cluster_secret,
        health_probe_interval_s=values.get("health_probe_interval", 30.0),
        health_probe_timeout_s=values.get("health_probe_timeout", 30.0),
        frontdoor_grouping=values.get("frontdoor_grouping", True),
        otlp=values.get("otlp"),
        metrics_on=values.get("metrics_on", True),
        trace_on=values.get("trace_on", True),
        max_hold_s=values.get("max_hold", 3600.0),
        client_share=values.get("client_share", 0.5),
        clients_share=values.get("clients_share", 0.5),
        lend=values.get("lend", True),
        lend_host=values.get("lend_host"),
        direct_path=values.get("direct_path", True),
    )


def _api_key(values: Mapping[str, Any]) -> str | None:
    """The key of the node's HTTP listeners (the front door's and the metrics one): from a file (`--api-key-file`,
    its first line) or `MESH_ACTOR_API_KEY` or the config file, never from the command line (every user of the host
    can read a process's argv)."""
    key: str | None = values.get("api_key")
    path = values.get("api_key_file")
    if path is not None:
        if key is not None:
            raise ConfigError("give the API key once: --api-key-file or MESH_ACTOR_API_KEY, not both")
        key = read_secret_file(str(path), "API key")
    for option, what in (("http", "the front door"), ("metrics", "the metrics listener")):
        address = values.get(option)
        if address is not None and not is_loopback(address[0]) and not key:
            raise ConfigError(
                f"{what} listens on {address[0]}, beyond loopback: set an API key (--api-key-file FILE or "
                "MESH_ACTOR_API_KEY)"
            )
    return key


def default_node_id() -> str:
    """The node id `mesh-actor run` takes when none is configured: the host name, as a subject token."""
    name = "".join(c if c.isalnum() or c in "_-" else "-" for c in socket.gethostname())[:64]
    return name or "node"


#: Serving settings only a model has: what its server is for and how it pools (a node serves generation unless
#: a model is an embedding or rerank model).
_MODELS_OWN = frozenset({"kind", "pooling"})


def _serving_settings(
    table: Any, env: Mapping[str, str], flags: Mapping[str, Any], toml_path: Path, *, l3_on: bool = False
) -> ServingSettings:
    """The node's serving settings. With L3 on, `swa_full` defaults to true: a restored window-sized SWA cache
    is re-processed in full by llama-server, so slot states of SWA models are only worth keeping with a full
    cache (which admission counts exactly); `--no-swa-full` (or `swa_full = false`) keeps the window."""
    merged: dict[str, Any] = {}
    if table is not None:
        if not isinstance(table, dict):
            raise ConfigError(f"{toml_path}: [serving] must be a table")
        merged.update(table)
    fields = ServingSettings.__struct_fields__
    for name in fields:
        raw = env.get(f"{ENV_PREFIX}SERVING_{name.upper()}")
        if raw is not None:
            merged[name] = raw  # msgspec's lax mode turns "4"/"true" into the field's type
    merged.update({k: v for k, v in flags.items() if v is not None})
    own = sorted(set(merged) & _MODELS_OWN)
    if own:
        raise ConfigError(
            f"serving settings: {', '.join(own)} is a model's own (a catalog entry's or a placement request's), "
            "not a node's: every model would be served so"
        )
    if l3_on:
        merged.setdefault("swa_full", True)
    try:
        return msgspec.convert(merged, ServingSettings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"serving settings: {exc}") from exc


def _settings_bounds(table: Any, env: Mapping[str, str], flags: Mapping[str, Any], toml_path: Path) -> SettingsBounds:
    """What this node accepts of a model's own settings (default: everything llama-server accepts)."""
    merged: dict[str, Any] = {}
    if table is not None:
        if not isinstance(table, dict):
            raise ConfigError(f"{toml_path}: [bounds] must be a table")
        merged.update(table)
    for name in SettingsBounds.__struct_fields__:
        raw = env.get(f"{ENV_PREFIX}BOUNDS_{name.upper()}")
        if raw is not None:
            merged[name] = raw
    merged.update({k: v for k, v in flags.items() if v is not None})
    for name, value in list(merged.items()):
        if isinstance(value, str) and name != "max_slots" and name != "max_spec_draft_n_max":
            merged[name] = [v.strip() for v in value.split(",") if v.strip()]  # a list given as "a,b"
    try:
        return msgspec.convert(merged, SettingsBounds, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bounds: {exc}") from exc
