"""What one damaged line of a session log costs, for every line of sessions of 10, 19 and 100 turns.

A 100-turn session is recorded through a real proxy (the fake engine behind it); its log's first
n + 1 lines are the log of the same session after n turns (logs are append-only). Each log is damaged
one line at a time in each way a disk or a crash damages it, and read back by the proxy's own recovery
(`proxy.capture.recovery.load_log`). Every turn served must be exactly the recorded one, and the turns lost to
one damaged line at most `whole_turn_every` (the default, 8), whatever the session's length. The
figures of the same measurement are printed by `benchmarks/chaos_bench.py --only damage`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from proxy_agent import Agent

from harness_rl.run.stack import serve_proxy
from harness_rl.trace import Turn
from proxy.capture.recovery import load_log
from proxy.config import ProxyConfig

BOUND = 8  # ProxyConfig's default whole_turn_every
LENGTHS = (10, 19, 100)


def _torn(lines: list[bytes], _: int) -> list[bytes]:
    return [*lines[:-1], lines[-1][:len(lines[-1]) // 2]]


def _corrupt(lines: list[bytes], i: int) -> list[bytes]:
    line = lines[i]
    return [*lines[:i], line[:30] + b"\0#corrupt#\0" + line[41:], *lines[i + 1:]]


def _duplicate(lines: list[bytes], i: int) -> list[bytes]:
    return [*lines[:i + 1], lines[i], *lines[i + 1:]]


def _missing(lines: list[bytes], i: int) -> list[bytes]:
    return [*lines[:i], *lines[i + 1:]]


# damage -> (how, which lines it is tried on given the log's line count, the most turns it may cost)
DAMAGE: dict[str, tuple[Callable[[list[bytes], int], list[bytes]], Callable[[int], range], int]] = {
    "torn last line": (_torn, lambda n: range(n - 1, n), 1),
    "corrupt line": (_corrupt, range, BOUND),
    "duplicate line": (_duplicate, range, 0),
    "missing line": (_missing, range, BOUND),
}


@pytest.fixture(scope="module")
def recorded(fake_engine_server: tuple[Any, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[list[bytes], list[Turn]]]:
    """The log lines of one 100-turn linear session (line 0 opens it) and its turns as the proxy served them."""
    fake_engine_server[0].script.clear()
    store = tmp_path_factory.mktemp("store")
    with serve_proxy(ProxyConfig(upstream=fake_engine_server[1], store_dir=str(store))) as proxy, \
            httpx.Client(timeout=30) as http:
        agent = Agent(proxy)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        for i in range(100):
            got = http.post(f"{agent.base}/chat/completions", json={"model": "m", "messages": messages},
                            headers=agent.auth)
            assert got.status_code == 200, got.text
            messages += [got.json()["choices"][0]["message"], {"role": "user", "content": f"step {i}"}]
        turns = agent.trace().turns
        yield (store / f"{agent.session['id']}.jsonl").read_bytes().splitlines(keepends=True), turns


def _exact(turn: Turn) -> bytes:
    """Everything a turn holds but its parent (which depends on the turns present)."""
    return msgspec.json.encode(msgspec.structs.replace(turn, parent_id=None))


def test_the_default_log_holds_every_eighth_turn_whole(recorded: tuple[list[bytes], list[Turn]]) -> None:
    from proxy.capture.store import decode_turn

    whole = [i for i, line in enumerate(recorded[0][1:]) if decode_turn(line.rstrip(b"\n")).base is None]
    assert ProxyConfig().whole_turn_every == BOUND and whole == list(range(0, 100, BOUND))


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_one_damaged_line_costs_at_most_the_bound(recorded: tuple[list[bytes], list[Turn]], tmp_path: Path,
                                                  damage: str, length: int) -> None:
    how, where, most = DAMAGE[damage]
    lines, turns = recorded[0][:length + 1], recorded[1][:length]
    exact = {t.node_id: _exact(t) for t in turns}
    log = tmp_path / "s0123456789abcdef01234567.jsonl"  # a session's file name (a stand-in keeps it as the id)
    costs = []
    for i in where(len(lines)):
        log.write_bytes(b"".join(how(lines, i)))
        loaded = load_log(log)
        assert loaded.session is not None, (damage, i)
        served = loaded.session.trace().turns
        assert all(_exact(t) == exact[t.node_id] for t in served), (damage, i)
        unread = int(damage != "duplicate line" and i > 0)  # the damaged turn itself: quarantined, or gone
        assert len(served) + len(loaded.lost) + unread == length, (damage, i)  # the rest: served or reported lost
        assert loaded.stand_in == (i == 0 and damage in ("corrupt line", "missing line"))
        costs.append(length - len(served))
    assert max(costs) <= most, (damage, length, costs)
    if damage in ("corrupt line", "missing line") and length >= BOUND:
        assert max(costs) == BOUND  # a whole turn's line is the worst: it and the turns resting on it
