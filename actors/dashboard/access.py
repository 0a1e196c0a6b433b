"""The dashboard's session cookie (dashboard core, pure): what a browser holds instead of the API key.

A browser's `EventSource` cannot send an `Authorization` header, and a key in a URL ends up in histories and
logs. So the page asks for the key once (a form posted to `/ui/session`), and the node answers with a cookie
(`HttpOnly`, `SameSite=Strict`, path `/ui`) holding `<expiry>.<HMAC-SHA256 of the expiry under the key>`: it
proves the key was presented without being the key, ends at its expiry, and stops working when the key changes.
Nothing is stored on the node. The clock is the caller's.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

__all__ = ["COOKIE", "SESSION_S", "session_token", "session_valid"]

COOKIE: Final = "mesh_ui_session"
#: How long a session lasts once the key was presented.
SESSION_S: Final = 12 * 3600
_CONTEXT: Final = b"mesh-actor dashboard session\x00"
_MAX_TOKEN: Final = 128


def _mac(key: str, expires: int) -> str:
    return hmac.new(key.encode(), _CONTEXT + str(expires).encode(), hashlib.sha256).hexdigest()


def session_token(key: str, now: float, lifetime_s: int = SESSION_S) -> str:
    """A token for a browser that presented `key` at `now` (unix seconds)."""
    expires = int(now) + lifetime_s
    return f"{expires}.{_mac(key, expires)}"


def session_valid(token: str | None, key: str, now: float) -> bool:
    """Whether `token` was made with `key` and has not expired at `now`."""
    if not token or len(token) > _MAX_TOKEN:
        return False
    expires_text, _, mac = token.partition(".")
    if not expires_text.isdigit() or len(expires_text) > 12:
        return False
    expires = int(expires_text)
    return now < expires and hmac.compare_digest(mac.encode(), _mac(key, expires).encode())
