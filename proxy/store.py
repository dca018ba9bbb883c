"""Durable per-session logs: one append-only JSON-lines file per session.

A turn is written (one `write` syscall, optionally fsync'd) before its reply leaves the proxy, so a
proxy killed at any moment loses no answered turn; a torn last line from a kill mid-write is
ignored on reading. Turn lines are `harness_rl.trace.StoredTurn`s, the one stored form of a turn,
delta-encoded against the earlier turn of the session sharing the longest token prefix, so a log
grows linearly with the conversation. The other lines record the session's own events.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from harness_rl.trace import StoredTurn


class SessionOpened(msgspec.Struct, tag="session", tag_field="kind", kw_only=True):
    id: str
    key: str
    created_at: float
    metadata: dict[str, Any] = {}
    max_turns: int | None = None
    max_tokens_per_turn: int | None = None


class Undelivered(msgspec.Struct, tag="undelivered", tag_field="kind"):
    """The agent never received this turn's completion (it disconnected mid-reply)."""

    node_id: str


class Closed(msgspec.Struct, tag="closed", tag_field="kind"):
    at: float


class BudgetStop(msgspec.Struct, tag="budget_stop", tag_field="kind"):
    at: float


Line = SessionOpened | StoredTurn | Undelivered | Closed | BudgetStop

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Line)
_TURN_DECODER = msgspec.json.Decoder(StoredTurn)


def encode_line(line: Line) -> bytes:
    return _ENCODER.encode(line) + b"\n"


def decode_turn(data: bytes) -> StoredTurn:
    return _TURN_DECODER.decode(data)


class SessionLog:
    """The append-only file of one session, opened on first write and closed with the session."""

    def __init__(self, path: Path, *, fsync: bool) -> None:
        self.path = path
        self._fsync = fsync
        self._fd = -1

    def append(self, data: bytes) -> None:
        """Write one encoded line; it reaches the kernel (and with fsync the disk) before this returns."""
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        written = os.write(self._fd, data)
        while written < len(data):
            written += os.write(self._fd, data[written:])
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def delete(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def read_log(path: Path) -> tuple[list[tuple[Line, bytes]], int]:
    """Every complete line of a session log with its raw bytes, and the byte length they span.

    A torn or unreadable tail (a kill mid-write) is left out; the caller truncates it away so the
    next append starts on a clean line.
    """
    data = path.read_bytes()
    out: list[tuple[Line, bytes]] = []
    good = 0
    while good < len(data):
        end = data.find(b"\n", good)
        if end < 0:
            break
        raw = data[good:end]
        try:
            out.append((_DECODER.decode(raw), raw))
        except msgspec.DecodeError:
            break
        good = end + 1
    return out, good
