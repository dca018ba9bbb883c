"""Reading a store back after a restart, trusting nothing in it and losing nothing good.

Each session log is scanned line by line (`proxy.capture.store.scan_log`): a damaged line is skipped,
counted, its bytes kept under `STORE/quarantine/` and logged once (when first quarantined); a line
logged twice counts once; nothing is ever truncated (a torn last line is only ended with a newline,
so the next append starts a line of its own). Every turn whose stored form does not depend on a
damaged or missing line is rebuilt exactly; one that does is counted lost and left out, never
guessed (`Session.replay`). A session whose own first line is damaged or missing keeps its turns:
it comes back closed, under the id its file is named by, without its metadata, budget or key (a
stand-in). A file that cannot be read at all is reported and skipped: one bad file never stops the
proxy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from harness_rl.trace import StoredTurn, TrainingTrace
from proxy.capture.session import SESSION_ID, Session, SessionRegistry
from proxy.capture.store import QUARANTINE, Damaged, Line, SessionLog, SessionOpened, end_line, quarantine, scan_log
from proxy.control_api import Recovery

log = logging.getLogger("harness_rl.proxy")


@dataclass(slots=True)
class LoadedLog:
    """One session log read back: the session (None if the file is not one) and what could not be used."""

    session: Session | None
    damaged: list[Damaged] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # reasons, one per logged turn that was not rebuilt
    duplicates: int = 0
    ends_clean: bool = True
    stand_in: bool = False  # the session line was damaged or missing: the session is a closed stand-in


def load_log(path: Path, *, fsync: bool = False, whole_turn_every: int | None = None) -> LoadedLog:
    """Rebuild a session from its log without writing anything; damaged and lost lines are reported."""
    scan = scan_log(path)
    loaded = LoadedLog(None, scan.damaged, duplicates=scan.duplicates, ends_clean=scan.ends_clean)
    lines = scan.lines
    if lines and isinstance(lines[0][0], SessionOpened):
        opened, lines = lines[0][0], lines[1:]
    elif SESSION_ID.fullmatch(path.stem) and any(isinstance(line, StoredTurn) for line, _, _ in lines):
        opened, loaded.stand_in = _stand_in(path.stem, lines), True
    else:
        loaded.lost = [f"{path.name} has no session line first" for line, _, _ in lines
                       if isinstance(line, StoredTurn)]
        return loaded
    session = loaded.session = Session(opened, SessionLog(path, fsync=fsync), whole_turn_every=whole_turn_every)
    for line, raw, offset in lines:
        problem = session.replay(line, raw)
        if problem is None:
            continue
        if problem.damaged:
            loaded.damaged.append(Damaged(offset, raw, problem.reason))
        if isinstance(line, StoredTurn):
            loaded.lost.append(problem.reason)
    loaded.damaged.sort(key=lambda d: d.offset)
    if loaded.stand_in:
        session.closed = True
        session.log.seal()  # nothing is appended to a log without its session line
    return loaded


def _stand_in(session_id: str, lines: list[tuple[Line, bytes, int]]) -> SessionOpened:
    """The session line of a log whose own is lost: its id from the file name; no key ever matches."""
    started = [line.started_at for line, _, _ in lines if isinstance(line, StoredTurn) and line.started_at]
    return SessionOpened(id=session_id, key_sha256=f"lost:{session_id}", created_at=min(started, default=0.0),
                         metadata={"session_line": "damaged or missing: metadata, budget and key unknown"})


def trace_from_log(path: Path) -> TrainingTrace:
    """The trace of one session log file, rebuilt as the proxy would serve it (read-only)."""
    loaded = load_log(path)
    if loaded.session is None:
        raise ValueError(f"{path} is not a proxy session log (no session line first)")
    return loaded.session.trace()


def recover_store(registry: SessionRegistry) -> Recovery:
    """Load every session log under the registry's store into it; what came back and what did not."""
    totals = registry.recovery = Recovery()
    for path in sorted(registry.store_dir.glob("s*.jsonl")):
        try:
            _recover_one(registry, path, totals)
        except Exception as exc:  # one bad file never stops the proxy
            totals.unreadable_files += 1
            log.warning("session log %s skipped: %s", path, exc)
    return totals


def _recover_one(registry: SessionRegistry, path: Path, totals: Recovery) -> None:
    """Recover one log; a file that is not a session's own log is left untouched (its turns count lost)."""
    loaded = load_log(path, fsync=registry.fsync, whole_turn_every=registry.whole_turn_every)
    session = loaded.session
    if session is None or session.id in registry.by_id:
        totals.lost_turns += len(loaded.lost) + (len(session.turns) if session is not None else 0)
        why = "no session line first" if session is None else f"a second log of session {session.id}"
        raise ValueError(f"not a session log ({why}); left as it is")
    totals.lost_turns += len(loaded.lost)
    totals.quarantined_lines += len(loaded.damaged)
    totals.duplicate_lines += loaded.duplicates
    kept = [p for p in (quarantine(registry.store_dir, path, d) for d in loaded.damaged) if p is not None]
    if loaded.stand_in:
        log.warning("session log %s: its session line is damaged or missing; its turns come back in a closed "
                    "session without its metadata and key", path)
    if kept or (loaded.lost and not loaded.damaged):
        log.warning("session log %s: %d damaged lines skipped (bytes kept in %s), %d turns lost: %s", path,
                    len(loaded.damaged), registry.store_dir / QUARANTINE, len(loaded.lost),
                    "; ".join([d.reason for d in loaded.damaged[:3]] + loaded.lost[:3]))
    if not loaded.ends_clean and not session.closed:
        end_line(path)
    totals.sessions += 1
    totals.turns += len(session.turns)
    registry.add(session)
