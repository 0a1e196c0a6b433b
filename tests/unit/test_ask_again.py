"""The one policy by which a pass-through request is asked again while an answer says nothing ran
(`runtime.generate_client.ask_again`): the caller's own router away or full, nobody listening, a lagging router."""

from __future__ import annotations

from messages.errors import BAD_REQUEST, BUSY, NO_INSTANCE, TIMEOUT, UNAVAILABLE, ErrorReply
from runtime.bus import NO_RESPONDERS_RETRY_S, NoResponders, RemoteError
from runtime.generate_client import LAG_RETRY_S, ROUTER_LAG_S, Again, ask_again

OWN = "mesh.router.n1.generate"


def _remote(code: str) -> RemoteError:
    return RemoteError("mesh.generate", ErrorReply(code=code, message="m"))


def test_the_own_router_away_or_full_sends_the_request_to_any_router_at_once() -> None:
    for error in (NoResponders(OWN), _remote(BUSY)):
        assert ask_again(error, OWN, own=OWN, now=1.0, first_try=0.0, deadline=30.0) == Again(None, 0.0)


def test_any_router_full_is_the_answer() -> None:
    assert ask_again(_remote(BUSY), None, own=OWN, now=1.0, first_try=0.0, deadline=30.0) is None


def test_nobody_listening_is_asked_again_own_router_first_until_the_deadline() -> None:
    again = ask_again(NoResponders("mesh.generate"), None, own=OWN, now=1.0, first_try=0.0, deadline=30.0)
    assert again == Again(OWN, NO_RESPONDERS_RETRY_S)
    assert ask_again(NoResponders("mesh.generate"), None, own=None, now=1.0, first_try=0.0, deadline=30.0) == Again(
        None, NO_RESPONDERS_RETRY_S
    )
    late = 30.0 - NO_RESPONDERS_RETRY_S
    assert ask_again(NoResponders("mesh.generate"), None, own=OWN, now=late, first_try=0.0, deadline=30.0) is None


def test_a_lagging_routers_no_instance_is_asked_again_for_a_bounded_time() -> None:
    for tried in (OWN, None):
        error = _remote(NO_INSTANCE)
        assert ask_again(error, tried, own=OWN, now=1.0, first_try=0.0, deadline=30.0) == Again(OWN, LAG_RETRY_S)
        assert ask_again(error, tried, own=OWN, now=ROUTER_LAG_S, first_try=0.0, deadline=30.0) is None
        assert ask_again(error, tried, own=OWN, now=1.0, first_try=0.0, deadline=1.1) is None  # the deadline first


def test_an_answer_that_says_something_ran_or_was_refused_is_never_asked_again() -> None:
    for error in (_remote(BAD_REQUEST), _remote(TIMEOUT), _remote(UNAVAILABLE)):
        for tried in (OWN, None):
            assert ask_again(error, tried, own=OWN, now=1.0, first_try=0.0, deadline=30.0) is None
