"""Durable per-session logs: one append-only JSON-lines file per session, private to its owner.

A turn is written (one `write` syscall, optionally fsync'd) before its reply leaves the proxy, so a
proxy killed at any moment loses no answered turn. Turn lines are `harness_rl.trace.StoredTurn`s,
the one stored form of a turn, delta-encoded against the earlier turn of the session sharing the
longest token prefix, so a log grows linearly with the conversation. The other lines record the
session's own events. The session key is kept only as its SHA-256: a log never holds a usable key.

Reading never trusts a file: `scan_log` returns every line that decodes, drops exact duplicates and
reports each damaged line (undecodable, or a torn tail) with its offset and bytes; nothing is ever
truncated. A damaged line's bytes are copied into the store's quarantine folder (`quarantine`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from harness_rl.trace import StoredTurn

QUARANTINE = "quarantine"


class SessionOpened(msgspec.Struct, tag="session", tag_field="kind", kw_only=True, omit_defaults=True):
    id: str
    key_sha256: str = ""  # the session key's SHA-256 (hex); agents are routed by hashing what they present
    key: str | None = None  # logs written before keys were hashed held the key itself
    created_at: float
    metadata: dict[str, Any] = {}
    max_turns: int | None = None
    max_tokens_per_turn: int | None = None
    seed: int | None = None

    @property
    def key_digest(self) -> str:
        return self.key_sha256 or key_digest(self.key or "")


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


def key_digest(key: str) -> str:
    """What a log and the registry keep of a session key."""
    return hashlib.sha256(key.encode()).hexdigest()


def encode_line(line: Line) -> bytes:
    return _ENCODER.encode(line) + b"\n"


def decode_turn(data: bytes) -> StoredTurn:
    return _TURN_DECODER.decode(data)


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) if needed and make it readable by its owner only (0700)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


class SessionSealed(RuntimeError):
    """An append to a log that was closed or deleted: nothing is written after that."""


class SessionLog:
    """The append-only file of one session, opened on first write; sealed (for good) by close or delete."""

    def __init__(self, path: Path, *, fsync: bool) -> None:
        self.path = path
        self._fsync = fsync
        self._fd = -1
        self.sealed = False

    def append(self, data: bytes) -> None:
        """Write one encoded line; it reaches the kernel (and with fsync the disk) before this returns."""
        if self.sealed:
            raise SessionSealed(f"{self.path.name} is closed; nothing more is written to it")
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        written = os.write(self._fd, data)
        while written < len(data):
            written += os.write(self._fd, data[written:])
        if self._fsync:
            os.fsync(self._fd)

    def seal(self) -> None:
        """Release the file and refuse every later append."""
        self.sealed = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def delete(self) -> None:
        self.seal()
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class Damaged:
    """A line that cannot be used: where it starts, its bytes (without the newline), and why."""

    offset: int
    raw: bytes
    reason: str


@dataclass(slots=True)
class LogScan:
    """Everything readable in one session log, and what was not."""

    lines: list[tuple[Line, bytes, int]] = field(default_factory=list)  # line, its bytes, its offset
    damaged: list[Damaged] = field(default_factory=list)
    duplicates: int = 0
    ends_clean: bool = True  # empty, or ends with a newline (else the next append must start a new line)


def scan_log(path: Path) -> LogScan:
    """Decode a session log line by line; a damaged line is reported and skipped, never the end of reading.

    A line identical to an earlier one (a replayed write) is counted once. A last line without its
    newline is kept if it decodes; otherwise it is a torn write, reported like any damaged line.
    """
    data = path.read_bytes()
    scan = LogScan(ends_clean=not data or data.endswith(b"\n"))
    seen: set[bytes] = set()
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        stop = len(data) if end < 0 else end
        raw = data[start:stop]
        if raw.strip():
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            if digest in seen:
                scan.duplicates += 1
            else:
                try:
                    scan.lines.append((_DECODER.decode(raw), raw, start))
                    seen.add(digest)
                except (msgspec.DecodeError, RecursionError) as exc:
                    reason = "torn write (no newline)" if end < 0 else f"undecodable: {exc}"
                    scan.damaged.append(Damaged(start, raw, reason))
        start = stop + 1
    return scan


def quarantine(store_dir: Path, log: Path, damaged: Damaged) -> Path | None:
    """Keep a damaged line's exact bytes as `quarantine/<log>@<offset>`; None if an earlier start already did."""
    folder = private_dir(store_dir / QUARANTINE)
    path = folder / f"{log.stem}@{damaged.offset}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return None
    with os.fdopen(fd, "wb") as file:
        file.write(damaged.raw)
    return path


def end_line(path: Path) -> None:
    """Terminate a torn last line with a newline, so the next append starts a line of its own."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"\n")
    finally:
        os.close(fd)
