"""docs/api.md is generated from the code; these tests fail when the committed file no longer matches it."""

from __future__ import annotations

import typing

import pytest

from docs import generate_api
from messages.events import AnyEvent
from messages.subjects import Subjects


def test_api_reference_matches_what_the_generator_renders_from_the_code() -> None:
    expected = generate_api.render()
    path = generate_api.API_MD
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current == expected:
        return
    old, new = current.splitlines(), expected.splitlines()
    line = next((i + 1 for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)) + 1)
    pytest.fail(
        f"docs/api.md is out of date (first difference at line {line}); "
        f"regenerate it from the repository root with `{generate_api.COMMAND}` and commit it",
        pytrace=False,
    )


def test_rendering_is_deterministic() -> None:
    assert generate_api.render() == generate_api.render()


def test_every_event_type_is_listed_with_its_subject() -> None:
    text = generate_api.render()
    subjects = Subjects()
    for event_type in typing.get_args(AnyEvent):
        tag = str(event_type.__struct_config__.tag)
        actors, _ = generate_api.EVENTS[event_type]
        actor = actors[0] if len(actors) == 1 else "<actor>"
        assert f"| `{tag}` | `{subjects.event(actor, tag, '<node>')}`" in text
        assert f"### {event_type.__name__}\n" in text


def test_every_event_class_is_in_the_union_and_documented() -> None:
    # reservation_rebooked was journaled but missing from both: no reader could decode it as an event.
    from messages import events

    def descendants(cls: type[events.Event]) -> set[type[events.Event]]:
        found: set[type[events.Event]] = set()
        for sub in cls.__subclasses__():
            found |= {sub} | descendants(sub)
        return found

    # the journaled ones are the leaves: a base such as InstanceEvent only shares fields
    defined = {c for c in descendants(events.Event) if c.__module__ == events.__name__ and not c.__subclasses__()}
    assert defined == set(typing.get_args(AnyEvent))
    assert defined == set(generate_api.EVENTS)
