"""The fake engine's reset (tests/fake_engine.py): the `fake_engine` fixture hands each test one as a new one is."""

from __future__ import annotations

from collections import deque
from dataclasses import fields
from typing import Any

from fake_engine import FakeEngine, Scripted


def moved(value: Any) -> Any:
    """A value other than `value`, of a kind a knob holds; containers gain an entry in place."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, deque):
        value.append(Scripted(content="left over"))
        return value
    if isinstance(value, list):
        value.append(7)
        return value
    if isinstance(value, dict):  # a Counter too
        value["left over"] = 1
        return value
    return "set by a test"  # None and the template


def knobs(fake: FakeEngine) -> dict[str, Any]:
    return {knob.name: getattr(fake, knob.name) for knob in fields(fake) if knob.name != "_cache"}


def test_reset_puts_every_knob_and_record_back_and_keeps_containers_in_place() -> None:
    fake = FakeEngine()
    for knob in fields(fake):
        setattr(fake, knob.name, moved(getattr(fake, knob.name)))
    script, routes = fake.script, fake.routes
    assert all(value != knobs(FakeEngine())[name] for name, value in knobs(fake).items())
    fake.reset()
    assert knobs(fake) == knobs(FakeEngine())
    assert fake.script is script and fake.routes is routes  # emptied, not replaced
    assert fake._cache  # the text-to-ids memo (no answer depends on it) is kept
