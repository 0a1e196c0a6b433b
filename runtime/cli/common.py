"""Options and helpers shared by the bus-facing commands: where the data dir is, how to reach NATS.

A client command finds the embedded server's URL and credentials in the data dir; `--nats` (and the
credential flags, or `MESH_ACTOR_NATS*` variables) point it at any other NATS deployment instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from runtime.bus import Bus, BusError, inbox_prefix_of
from runtime.config import (
    CONFIG_FILE,
    ConfigError,
    NatsOptions,
    NodeConfig,
    default_data_dir,
    load_config,
    read_password_file,
)
from runtime.creds import CredentialsError, with_creds_file, write_private
from runtime.embedded import EmbeddedNatsError, read_credentials
from runtime.roles import is_client_user

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """Reports a usage error as one line on stderr (exit code 2) instead of the usage text plus the error.
    Flags are never abbreviated: `--nats-password SECRET` must be an error, not `--nats-password-file SECRET`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class CliError(Exception):
    """A failure to report on stderr as one line, with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def add_data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        help="node data dir (default: $MESH_ACTOR_HOME or ~/.local/share/mesh-actor)",
    )


def add_nats_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("NATS connection (default: the embedded server recorded in the data dir)")
    group.add_argument("--nats", action="append", metavar="URL", help="NATS URL; repeat or comma-separate for several")
    group.add_argument("--nats-user")
    # No --nats-password: a password on the command line is visible to every user of the host (ps, /proc).
    group.add_argument(
        "--nats-password-file",
        metavar="FILE",
        help="file holding the NATS password (or set MESH_ACTOR_NATS_PASSWORD); never pass it in argv",
    )
    group.add_argument("--nats-token")
    group.add_argument("--nats-creds", metavar="FILE", help="NATS credentials file (JWT + nkey)")
    group.add_argument("--nats-tls-ca", metavar="FILE")
    group.add_argument("--nats-tls-cert", metavar="FILE")
    group.add_argument("--nats-tls-key", metavar="FILE")
    group.add_argument("--prefix", help="subject prefix (default: mesh)")


def add_client_options(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    add_data_dir(parser)
    add_nats_options(parser)
    if json_flag:
        parser.add_argument("--json", action="store_true", help="machine-readable output")


def data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) if getattr(args, "data_dir", None) else default_data_dir(os.environ)


def _flag_or_env(args: argparse.Namespace, name: str) -> str | None:
    value = getattr(args, name, None)
    if value is None:
        value = os.environ.get(f"MESH_ACTOR_{name.upper()}")
    return str(value) if value is not None else None


def _client_password(args: argparse.Namespace) -> str | None:
    path = _flag_or_env(args, "nats_password_file")
    if path is None:
        return os.environ.get("MESH_ACTOR_NATS_PASSWORD")
    try:
        return read_password_file(path)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc


def client_options(args: argparse.Namespace) -> NatsOptions:
    """How this command reaches NATS: flags, then MESH_ACTOR_NATS* variables, then the data dir."""
    urls: list[str] = []
    for item in getattr(args, "nats", None) or []:
        urls += [u.strip() for u in item.split(",") if u.strip()]
    if not urls and os.environ.get("MESH_ACTOR_NATS"):
        urls = [u.strip() for u in os.environ["MESH_ACTOR_NATS"].split(",") if u.strip()]
    creds_file = _flag_or_env(args, "nats_creds")
    if urls or creds_file:
        try:  # our JSON credentials file (`mesh-actor creds issue`) names its URLs, user and CA
            return _with_creds(
                NatsOptions(
                    urls=tuple(urls),
                    user=_flag_or_env(args, "nats_user"),
                    password=_client_password(args),
                    token=_flag_or_env(args, "nats_token"),
                    creds_file=creds_file,
                    tls_ca=_flag_or_env(args, "nats_tls_ca"),
                    tls_cert=_flag_or_env(args, "nats_tls_cert"),
                    tls_key=_flag_or_env(args, "nats_tls_key"),
                )
            )
        except CredentialsError as exc:
            raise CliError(str(exc), EXIT_USAGE) from exc
    configured = node_config(args)
    if configured is not None and configured.nats.urls:  # the node of this data dir uses an external NATS
        return configured.nats
    directory = data_dir(args)
    try:
        creds = read_credentials(directory)
    except EmbeddedNatsError as exc:
        raise CliError(str(exc)) from exc
    if creds is None:
        raise CliError(
            f"no NATS to talk to: {directory} has no embedded server record; start `mesh-actor run` "
            "(or pass --data-dir of a running node, or --nats URL)"
        )
    return creds.options()


def _with_creds(options: NatsOptions) -> NatsOptions:
    resolved = with_creds_file(options)
    if not resolved.urls:
        raise CliError(f"{options.creds_file} names no URL: pass --nats URL too", EXIT_USAGE)
    return resolved


def node_config(args: argparse.Namespace) -> NodeConfig | None:
    """The configuration of the node that owns the data dir (config.toml and MESH_ACTOR_* variables), if any."""
    directory = data_dir(args)
    if not (directory / CONFIG_FILE).exists():
        return None
    try:
        return load_config({"data_dir": str(directory), "node_id": "client"}, os.environ)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc


def prefix(args: argparse.Namespace) -> str:
    """The subject prefix: --prefix, MESH_ACTOR_PREFIX, the data dir's config.toml, else `mesh`."""
    explicit = getattr(args, "prefix", None) or os.environ.get("MESH_ACTOR_PREFIX")
    if explicit:
        return str(explicit)
    configured = node_config(args)
    return configured.prefix if configured is not None else "mesh"


def refuse_client(args: argparse.Namespace, what: str) -> None:
    """A `CliError` when the command would connect as a `client` user, which may not read `what` (its account
    has no route to it: the server would refuse, after a timeout)."""
    user = client_options(args).user
    if user and is_client_user(user):
        raise CliError(f"{what} cannot be read with these credentials: a client's (the mesh's node or admin do)")


async def connect(args: argparse.Namespace, name: str) -> Bus:
    try:
        return await Bus.connect(client_options(args), name=f"mesh-actor {name}", deadline_s=5.0)
    except BusError as exc:
        raise CliError(str(exc)) from exc


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=None, sort_keys=False) + "\n")
    sys.stdout.flush()


def connection_record(options: NatsOptions) -> dict[str, str]:
    """How any NATS client connects as `options` says: URL(s), credentials, TLS CA, and the inbox prefix the
    user must receive replies on (`_INBOX.<user>`: its role may subscribe to nothing else, so a client that
    keeps the default `_INBOX.` waits for answers that never come)."""
    record: dict[str, str] = {"url": ",".join(options.urls)}
    if options.creds_file:
        record["creds"] = options.creds_file
    elif options.token:
        record["token"] = options.token
    elif options.user:
        record.update(user=options.user, password=options.password or "")
    if options.tls_ca:
        record["tls_ca"] = options.tls_ca
    if options.tls_cert:
        record.update(tls_cert=options.tls_cert, tls_key=options.tls_key or "")
    prefix = inbox_prefix_of(options)
    if prefix is not None:
        record["inbox_prefix"] = prefix
    return record


_CONTEXT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Our record's keys as the `nats` CLI's context names them (ADR-21, NATS configuration contexts).
_CONTEXT_KEYS = {
    "url": "url", "user": "user", "password": "password", "token": "token", "creds": "creds", "tls_ca": "ca",
    "tls_cert": "cert", "tls_key": "key", "inbox_prefix": "inbox_prefix",
}  # fmt: skip


def write_nats_context(name: str, record: dict[str, str], env: dict[str, str]) -> Path:
    """Writes `record` as the `nats` CLI context `name` (`$XDG_CONFIG_HOME/nats/context/<name>.json`, 0600 in a
    0700 directory: it holds a password), replacing one of that name. Returns its path."""
    if not _CONTEXT_NAME.match(name):
        raise CliError(f"context name {name!r}: use letters, digits, '-' and '_' only", EXIT_USAGE)
    config_home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    directory = config_home / "nats" / "context"
    context = {"description": "mesh-actor", **{_CONTEXT_KEYS[k]: v for k, v in record.items()}}
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = directory / f"{name}.json"
        write_private(path, json.dumps(context, indent=2) + "\n")
    except OSError as exc:
        raise CliError(f"cannot write the nats context {name}: {exc}") from exc
    return path
