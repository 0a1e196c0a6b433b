"""Prompts an instance rendered, remembered by the body they were rendered from (runner core, pure).

A pass-through body's prompt tokens come from the instance itself (`/apply-template`, then `/tokenize`): two
round trips to the server before the slot can be chosen, some 3 ms on a small model, paid again by every request
that sends the same bytes (a retry, a repeated question, a client polling with one prompt). The server renders a
body from that body alone (its template and tokenizer are the instance's, fixed while it runs), so the same
endpoint and the same bytes give the same tokens: `RenderMemo` keeps them, per instance incarnation.

Rules this module keeps:

* The key is the request's cache scope, the endpoint and a digest of the client's body as it came, byte for byte:
  only a body sent again unchanged is answered from here, and only to its own scope (a render answered sooner
  would tell a tenant that another sent the same body: scopes share no prompt state, not even this). Nothing of
  the body is interpreted.
* An entry lives `ttl_s` (a template may read the date: a day's change is picked up within that time; a stale
  entry would cost a slot choice time, never an answer's correctness, as the server renders what it is sent).
* Bounded: at most `max_entries` entries and `max_tokens` tokens in all, the least recently used leaving first;
  a prompt longer than `max_entry_tokens` is not kept.
* What the render checked before it asked the server (the prompt's size against the slot's context) is checked
  again on every use: the entry keeps the rendered prompt's size for it (`Rendered.text_bytes`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

__all__ = ["RenderMemo", "Rendered", "render_key"]

#: How long a remembered render is used (seconds).
TTL_S: Final = 60.0


@dataclass(frozen=True)
class Rendered:
    """A body's prompt as the instance rendered it: its tokens, and the rendered text's size in UTF-8 bytes."""

    tokens: tuple[int, ...]
    text_bytes: int


def render_key(scope: str, endpoint: str, body: bytes) -> bytes:
    """The memo's key of a body sent to `endpoint` by a request of cache scope `scope`: a digest of all three (the
    body as it came, byte for byte)."""
    digest = hashlib.blake2b(scope.encode(), digest_size=20)
    for part in (endpoint.encode(), body):
        digest.update(b"\0")
        digest.update(part)
    return digest.digest()


class RenderMemo:
    """Renders of one instance incarnation by `render_key`; `now` is the caller's monotonic clock."""

    def __init__(
        self,
        *,
        ttl_s: float = TTL_S,
        max_entries: int = 256,
        max_tokens: int = 1 << 18,
        max_entry_tokens: int = 1 << 15,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._max_tokens = max_tokens
        self._max_entry_tokens = max_entry_tokens
        self._entries: OrderedDict[bytes, tuple[Rendered, float]] = OrderedDict()  # key -> (render, expiry)
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """The tokens held in all."""
        return self._tokens

    def get(self, key: bytes, now: float) -> Rendered | None:
        held = self._entries.get(key)
        if held is None:
            return None
        rendered, expiry = held
        if now >= expiry:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return rendered

    def put(self, key: bytes, rendered: Rendered, now: float) -> None:
        if len(rendered.tokens) > self._max_entry_tokens or self._max_entries < 1:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (rendered, now + self._ttl_s)
        self._tokens += len(rendered.tokens)
        while len(self._entries) > self._max_entries or self._tokens > self._max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: bytes) -> None:
        rendered, _ = self._entries.pop(key)
        self._tokens -= len(rendered.tokens)
