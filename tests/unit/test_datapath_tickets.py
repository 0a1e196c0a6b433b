"""The ticket rules of the direct data path (pure): one use, bound fields, expiry, a bounded book."""

from __future__ import annotations

from runtime.tickets import Grant, TicketBook, TicketReason, TicketRefusal

D = "a" * 64


def grant(expires_at: float = 10.0, **kwargs: object) -> Grant[str]:
    fields: dict[str, object] = {"receiver": "b", "digest": D, "offset": 0, "length": 100, "chunk": 10}
    fields.update(kwargs)
    return Grant(expires_at=expires_at, handler="h", **fields)  # type: ignore[arg-type]


def redeem(book: TicketBook[str], ticket: str, now: float = 1.0, **kwargs: object) -> Grant[str] | TicketRefusal:
    asked: dict[str, object] = {"receiver": "b", "digest": D, "offset": 0, "length": 100, "chunk": 10}
    asked.update(kwargs)
    return book.redeem(ticket, now=now, **asked)  # type: ignore[arg-type]


def reason(result: Grant[str] | TicketRefusal) -> TicketReason | None:
    return result.reason if isinstance(result, TicketRefusal) else None


def test_a_ticket_opens_what_it_was_issued_for_once() -> None:
    book: TicketBook[str] = TicketBook(4)
    assert book.issue("t1", grant(), now=0.0) is None
    assert isinstance(redeem(book, "t1"), Grant)
    assert reason(redeem(book, "t1")) is TicketReason.USED
    assert reason(redeem(book, "t2")) is TicketReason.UNKNOWN


def test_any_bound_field_that_differs_refuses_the_hello_and_uses_the_ticket_up() -> None:
    for field, value in (("receiver", "c"), ("digest", "b" * 64), ("offset", 10), ("length", 90), ("chunk", 20)):
        book: TicketBook[str] = TicketBook(4)
        book.issue("t", grant(), now=0.0)
        refused = redeem(book, "t", **{field: value})  # type: ignore[arg-type]
        assert reason(refused) is TicketReason.FOREIGN and field in str(refused)
        assert reason(redeem(book, "t")) is TicketReason.USED


def test_an_expired_ticket_is_refused_and_forgotten_tickets_stay_refused() -> None:
    book: TicketBook[str] = TicketBook(4)
    book.issue("t", grant(expires_at=5.0), now=0.0)
    assert reason(redeem(book, "t", now=5.0)) is TicketReason.EXPIRED
    book.forget(now=6.0)
    assert reason(redeem(book, "t", now=6.0)) is TicketReason.UNKNOWN


def test_the_book_is_bounded_and_expired_tickets_make_room() -> None:
    book: TicketBook[str] = TicketBook(2)
    assert book.issue("a", grant(expires_at=5.0), now=0.0) is None
    assert book.issue("b", grant(expires_at=5.0), now=0.0) is None
    full = book.issue("c", grant(), now=1.0)
    assert full is not None and full.reason is TicketReason.FULL
    assert book.issue("c", grant(expires_at=20.0), now=5.0) is None  # a and b expired
    assert len(book) == 1
    assert book.withdraw("c") is not None and len(book) == 0
