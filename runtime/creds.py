"""Credentials with roles: the users file of the embedded server and the credentials files handed out.

`users.json` in the data dir (mode 0600) lists every issued user with its password and role; the embedded
server's config is generated from it (permissions from `runtime.roles`), so issuing a user is: add it here,
rewrite the config, make the running server reload it (SIGHUP: no connection is dropped). A credentials file
(0600, JSON: `url`, `user`, `password`, `role`, and `tls_ca` when the server speaks TLS) is what a client
or node is given; `--nats-creds FILE` accepts it wherever a NATS JWT credentials file is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from runtime.config import NatsOptions
from runtime.roles import CLIENT_USER_PREFIX, Role, is_client_user

USERS_FILE = "users.json"


class CredentialsError(RuntimeError):
    """A users or credentials file is unreadable, or a credential cannot be issued."""


@dataclass(frozen=True, slots=True)
class IssuedUser:
    user: str
    password: str
    role: Role


def write_private(path: Path, text: str) -> None:
    """Writes `text` to `path` atomically, readable by its owner only."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def read_users(data_dir: Path) -> list[IssuedUser]:
    path = data_dir / USERS_FILE
    try:
        raw = json.loads(path.read_text())
        return [IssuedUser(str(u["user"]), str(u["password"]), Role.parse(str(u["role"]))) for u in raw["users"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"{path} is unreadable: {exc}") from exc


def _write_users(data_dir: Path, users: list[IssuedUser]) -> None:
    record = {"users": [{"user": u.user, "password": u.password, "role": str(u.role)} for u in users]}
    write_private(data_dir / USERS_FILE, json.dumps(record, indent=2))


def user_name(role: Role) -> str:
    """A fresh user name for `role` (one subject token: it also names the user's inbox, `roles.inbox_prefix`)."""
    return f"node-{role.node}" if role.node else f"{role.kind}-{secrets.token_hex(4)}"


def issue(data_dir: Path, role: Role, *, user: str | None = None) -> IssuedUser:
    """Adds a user with a random password to the users file (a node user is issued once: the same one is
    returned again, so a node keeps its name and inbox)."""
    name = user or user_name(role)
    if is_client_user(name) != (role.kind == "client"):  # the name decides the inbox (roles.inbox_prefix)
        raise CredentialsError(f"user {name!r}: only {CLIENT_USER_PREFIX}… names a client, and every client")
    data_dir.mkdir(parents=True, exist_ok=True)
    users = read_users(data_dir)
    for existing in users:
        if existing.user == name:
            if existing.role != role:
                raise CredentialsError(f"user {name!r} exists with role {existing.role}, not {role}")
            return existing
    issued = IssuedUser(name, secrets.token_hex(24), role)
    _write_users(data_dir, [*users, issued])
    return issued


@dataclass(frozen=True, slots=True)
class CredsFile:
    """A credentials file: how one user of one role reaches the mesh."""

    urls: tuple[str, ...]
    user: str
    password: str
    role: str
    tls_ca: str | None = None

    def to_json(self) -> str:
        record: dict[str, object] = {
            "url": ",".join(self.urls),
            "user": self.user,
            "password": self.password,
            "role": self.role,
        }
        if self.tls_ca:
            record["tls_ca"] = self.tls_ca
        return json.dumps(record, indent=2) + "\n"

    def options(self) -> NatsOptions:
        return NatsOptions(urls=self.urls, user=self.user, password=self.password, tls_ca=self.tls_ca)


def read_creds_file(path: str | Path) -> CredsFile | None:
    """Our JSON credentials file at `path`; None when it is something else (a NATS JWT `.creds` file)."""
    try:
        text = Path(path).read_text()
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"cannot read the credentials file {path}: {exc}") from exc
    if not text.lstrip().startswith("{"):
        return None
    try:
        raw = json.loads(text)
        urls = tuple(u.strip() for u in str(raw["url"]).split(",") if u.strip())
        tls_ca = raw.get("tls_ca")
        return CredsFile(urls, str(raw["user"]), str(raw["password"]), str(raw["role"]), tls_ca and str(tls_ca))
    except (ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"the credentials file {path} is malformed: {exc}") from exc


def with_creds_file(options: NatsOptions) -> NatsOptions:
    """`options` with our credentials file (if `creds_file` names one) turned into user, password, TLS CA
    and, when none are given, URLs. A JWT credentials file is left to the NATS client."""
    if not options.creds_file:
        return options
    creds = read_creds_file(options.creds_file)
    if creds is None:
        return options
    return dataclasses.replace(
        options,
        urls=options.urls or creds.urls,
        user=creds.user,
        password=creds.password,
        creds_file=None,
        tls_ca=options.tls_ca or creds.tls_ca,
    )
