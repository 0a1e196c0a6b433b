"""One-shot tickets of the direct data path (pure): what a ticket opens, and whether a hello may use it.

A ticket is issued by the node that listens, inside its NATS reply to the node that asked (the shell draws its
32 random bytes), and is bound to what moves (`digest`, the byte range `offset`/`length`, the `chunk` size of
the frames), to whom (`receiver`: the node that asked) and until when (`expires_at`, on the listener's clock).
The rules, all of them here:

* A ticket opens at most one connection: the first hello that names it uses it up, whether it is then
  accepted or refused (a ticket shown with the wrong digest, range or receiver is someone else's or a probe;
  it is not left for a second try).
* A hello is accepted only when every bound field is what the ticket was issued for, and before it expires.
* The book is bounded (`capacity`): a listener that holds that many live tickets issues no more (the asker
  falls back to the NATS path) and used or expired ones are forgotten once their expiry passes.
* Tickets are kept by their blake3, not by their text: the book holds nothing a memory dump could replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

import blake3

__all__ = ["Grant", "TicketBook", "TicketReason", "TicketRefusal", "ticket_key"]

H = TypeVar("H")


class TicketReason(StrEnum):
    """Why a hello was refused (`DataAnswer.reason`)."""

    UNKNOWN = "ticket_unknown"  # no such ticket was issued here (or it expired long ago and was forgotten)
    USED = "ticket_used"  # the ticket opened a connection already
    EXPIRED = "ticket_expired"  # presented after its expiry
    FOREIGN = "ticket_foreign"  # issued for another digest, range, chunk size or receiver
    FULL = "tickets_full"  # the listener holds its most live tickets (issuing, not a hello)
    CLOSED = "listener_closed"  # the listener is not listening (issuing, not a hello)


@dataclass(frozen=True, slots=True)
class TicketRefusal:
    reason: TicketReason
    detail: str

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Grant(Generic[H]):
    """What a ticket was issued for; `handler` is the shell's (what the listener does with an accepted hello)."""

    receiver: str
    digest: str
    offset: int
    length: int
    chunk: int
    expires_at: float
    handler: H


def ticket_key(ticket: str) -> str:
    """How the book keeps a ticket: its blake3 (a lookup by this leaks nothing about the ticket's text)."""
    return str(blake3.blake3(ticket.encode("ascii", errors="replace")).hexdigest())


class TicketBook(Generic[H]):
    """The tickets a listener issued: live ones (not yet used), and used ones until they expire."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._live: dict[str, Grant[H]] = {}
        self._used: dict[str, float] = {}  # key -> when it may be forgotten

    def __len__(self) -> int:
        return len(self._live)

    def issue(self, ticket: str, grant: Grant[H], now: float) -> TicketRefusal | None:
        """Records `ticket` for `grant`; refused when the book is full."""
        self.forget(now)
        if len(self._live) >= self.capacity:
            return TicketRefusal(TicketReason.FULL, f"the listener holds {len(self._live)} live tickets, its most")
        self._live[ticket_key(ticket)] = grant
        return None

    def redeem(
        self, ticket: str, *, receiver: str, digest: str, offset: int, length: int, chunk: int, now: float
    ) -> Grant[H] | TicketRefusal:
        """The grant a hello opens, or why not. Any hello naming a known ticket uses it up."""
        key = ticket_key(ticket)
        if key in self._used:
            return TicketRefusal(TicketReason.USED, "this ticket opened a connection already")
        grant = self._live.pop(key, None)
        if grant is None:
            return TicketRefusal(TicketReason.UNKNOWN, "no such ticket was issued here")
        self._used[key] = grant.expires_at
        if now >= grant.expires_at:
            return TicketRefusal(TicketReason.EXPIRED, f"the ticket expired {now - grant.expires_at:.3f}s ago")
        asked = (receiver, digest, offset, length, chunk)
        if asked != (grant.receiver, grant.digest, grant.offset, grant.length, grant.chunk):
            wrong = [
                name
                for name, a, b in zip(
                    ("receiver", "digest", "offset", "length", "chunk"),
                    asked,
                    (grant.receiver, grant.digest, grant.offset, grant.length, grant.chunk),
                    strict=True,
                )
                if a != b
            ]
            return TicketRefusal(TicketReason.FOREIGN, f"the ticket was issued for another {', '.join(wrong)}")
        return grant

    def withdraw(self, ticket: str) -> Grant[H] | None:
        """Takes back a ticket that was not used (the transfer went another way)."""
        return self._live.pop(ticket_key(ticket), None)

    def forget(self, now: float) -> None:
        """Drops what expired: used tickets (a replay is then `ticket_unknown`, still refused) and live ones
        (a handler holds no resource: it opens what it sends when its connection comes)."""
        self._used = {k: t for k, t in self._used.items() if t > now}
        self._live = {k: g for k, g in self._live.items() if g.expires_at > now}
