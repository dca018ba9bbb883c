"""A `TrainingTrace`: one rollout, every model call the agent made as `Turn`s, and its metadata.

It is a strict superset of OpenEnv's `TrainingTrace` (same names and meanings for the shared fields).
Three file formats, told apart on reading: `delta` (the stored form, the default on disk), `full`
(plain JSON of every `Turn`, readable by any JSON parser) and `openenv` (OpenEnv's exact shape).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from harness_rl.trace.openenv import OPENENV_DEFAULT_ID, from_openenv, to_openenv
from harness_rl.trace.stored import (
    JSON_ENCODER,
    MSGPACK_ENCODER,
    SNIFF_JSON,
    STORED_JSON,
    STORED_MSGPACK,
    StoredTrace,
    decode,
    decode_json_object,
    rebuild_turns,
    store_trace,
)
from harness_rl.trace.turn import SCHEMA_VERSION, TraceValidationError, Turn, Violation, find_violations

TraceFormat = Literal["full", "delta", "openenv"]
FORMATS: tuple[TraceFormat, ...] = ("full", "delta", "openenv")
MSGPACK_SUFFIXES = (".msgpack", ".mpk")


class TrainingTrace(msgspec.Struct, kw_only=True):
    """One rollout's turns, plus free-form metadata (task, harness, reward bookkeeping)."""

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    turns: list[Turn] = []
    metadata: dict[str, Any] = {}

    def violations(self) -> list[Violation]:
        return find_violations(self.turns, self.schema_version)

    def validate(self) -> TrainingTrace:
        """Raise `TraceValidationError` naming every broken rule; return self when clean."""
        found = self.violations()
        if found:
            raise TraceValidationError(found)
        return self

    def turn(self, node_id: str) -> Turn:
        for turn in self.turns:
            if turn.node_id == node_id:
                return turn
        raise KeyError(node_id)

    def to_json(self, format: TraceFormat = "delta") -> bytes:
        """The trace as JSON: `delta` (compact, the file form), `full` (every turn whole) or `openenv`."""
        if format == "full":
            return JSON_ENCODER.encode(self)
        if format == "openenv":
            return JSON_ENCODER.encode(self.to_openenv())
        return JSON_ENCODER.encode(self._stored())

    def to_msgpack(self) -> bytes:
        return MSGPACK_ENCODER.encode(self._stored())

    def _stored(self) -> StoredTrace:
        return store_trace(self.rollout_id, self.turns, self.metadata, self.schema_version)

    @classmethod
    def _from_stored(cls, stored: StoredTrace) -> TrainingTrace:
        return cls(schema_version=stored.schema_version, rollout_id=stored.rollout_id,
                   turns=rebuild_turns(stored.turns), metadata=stored.metadata)

    @classmethod
    def from_json(cls, data: bytes | str) -> TrainingTrace:
        """Read any of the three JSON formats."""
        kind = decode(SNIFF_JSON, data, "JSON")
        if kind.format is not None or kind.rollout_id is None and not kind.turns:
            return cls._from_stored(decode(STORED_JSON, data, "JSON"))
        if kind.rollout_id is not None:
            return decode(_FULL_JSON, data, "JSON")
        return cls.from_openenv(decode_json_object(data))

    @classmethod
    def from_msgpack(cls, data: bytes) -> TrainingTrace:
        return cls._from_stored(decode(STORED_MSGPACK, data, "msgpack"))

    def save(self, path: str | Path, format: TraceFormat = "delta") -> None:
        """Write the trace; `.msgpack` / `.mpk` suffixes get the delta form in msgpack, anything else JSON."""
        path = Path(path)
        path.write_bytes(self.to_msgpack() if path.suffix in MSGPACK_SUFFIXES else self.to_json(format))

    @classmethod
    def load(cls, path: str | Path) -> TrainingTrace:
        """Read a trace file in any of our formats or OpenEnv's JSON (named after the file when it has no id)."""
        path = Path(path)
        data = path.read_bytes()
        if path.suffix in MSGPACK_SUFFIXES:
            return cls.from_msgpack(data)
        trace = cls.from_json(data)
        if trace.rollout_id == OPENENV_DEFAULT_ID:
            trace.rollout_id = path.stem
        return trace

    def to_openenv(self) -> dict[str, Any]:
        """OpenEnv's exact `TrainingTrace` JSON shape (`trace.openenv`)."""
        return to_openenv(self.rollout_id, self.turns)

    @classmethod
    def from_openenv(cls, data: dict[str, Any], rollout_id: str = OPENENV_DEFAULT_ID) -> TrainingTrace:
        """Read OpenEnv's `TrainingTrace` JSON (`trace.openenv`)."""
        rollout_id, turns = from_openenv(data, rollout_id=rollout_id)
        return cls(rollout_id=rollout_id, turns=turns)


_FULL_JSON = msgspec.json.Decoder(TrainingTrace)
