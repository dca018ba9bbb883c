"""What a damaged session log costs, and what bounding that cost costs on disk.

Everything runs against `harness-rl serve proxy` processes in front of the fast fake engine
(tests/fake_engine.py). Figures printed:

  damaged stores the log of one 100-turn session, cut to 10, 19 and 100 turns (logs are append-only),
                 damaged four ways (its torn last line; each line in turn corrupt, duplicated or
                 missing) and read back by the proxy's own recovery (proxy.capture.recovery.load_log): the
                 turns lost per damaged line (max, median, mean) with the default --whole-turn-every 8
                 beside the same session logged as deltas only (--whole-turn-every none), and whether
                 every turn served is exact. Then end to end: a restarted proxy on a 19-turn log whose
                 worst line (a whole turn) is damaged each way: trace status, turns served, lost /
                 quarantined / duplicate counts, whether the file was left as it was, the other
                 session intact
  chain cost     bytes per turn of a 50- and a 200-turn agent session (12 KB system prompt, 2 KB tool
                 output per step) for --whole-turn-every none, 32, 16, 8, 4

Run: `.venv/bin/python benchmarks/store_bench.py [--quick]` (about three minutes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from chaos_bench import SYSTEM, ProxyProcess, chat, fetch_trace, health, new_session, start_engine
from conventions import load_average, parse_args

from proxy.capture.recovery import load_log
from proxy.config import ProxyConfig

# ---------------------------------------------------------------------------------------- damaged stores


def _torn(lines: list[bytes], _: int) -> list[bytes]:
    return [*lines[:-1], lines[-1][:len(lines[-1]) // 2]]


def _corrupt(lines: list[bytes], i: int) -> list[bytes]:
    return [*lines[:i], lines[i][:30] + b"\0#corrupt#\0" + lines[i][41:], *lines[i + 1:]]


def _duplicate(lines: list[bytes], i: int) -> list[bytes]:
    return [*lines[:i + 1], lines[i], *lines[i + 1:]]


def _missing(lines: list[bytes], i: int) -> list[bytes]:
    return [*lines[:i], *lines[i + 1:]]


# damage -> how, and which lines of an n-line log it is tried on
DAMAGE: dict[str, tuple[Callable[[list[bytes], int], list[bytes]], Callable[[int], range]]] = {
    "torn last line": (_torn, lambda n: range(n - 1, n)), "corrupt line": (_corrupt, range),
    "duplicate line": (_duplicate, range), "missing line": (_missing, range),
}
LENGTHS = (10, 19, 100)
RESTARTED = 19  # the end-to-end run's log length: its turn 8 is logged whole


def _comparable(turn: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in turn.items() if k != "parent_id"}, sort_keys=True)


async def _record(proxy: ProxyProcess, turns: int) -> tuple[str, list[dict[str, Any]]]:
    """One linear session of `turns` calls through the proxy: its id and its turns as served."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        info = await new_session(http, proxy.url)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        for i in range(turns):
            content = await chat(http, info["openai_base_url"], info["key"], messages, stream=False)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"step {i}"}]
        return info["id"], (await fetch_trace(http, proxy.url, info["id"]))[1]["turns"]


def _costs(log_lines: list[bytes], served: list[dict[str, Any]], damage: str, length: int,
           work: Path) -> tuple[list[int], bool]:
    """Turns lost to each damaged line of the log's first `length` turns, and whether every turn served was exact."""
    how, where = DAMAGE[damage]
    exact = {t["node_id"]: _comparable(t) for t in served}
    lines, costs, all_exact = log_lines[:length + 1], [], True
    path = work / "s0123456789abcdef01234567.jsonl"  # a session's file name (a lost session line keeps it as id)
    for i in where(length + 1):
        path.write_bytes(b"".join(how(lines, i)))
        loaded = load_log(path)
        assert loaded.session is not None
        turns = json.loads(loaded.session.trace().to_json("full"))["turns"]
        all_exact &= all(exact[t["node_id"]] == _comparable(t) for t in turns)
        costs.append(length - len(turns))
    return costs, all_exact


async def damaged_stores(engine: str, work: Path, lengths: list[int]) -> None:
    """Every line of session logs of `lengths` turns (10, 19, 100) damaged in turn, read back by the proxy's
    recovery."""
    bound = ProxyConfig().whole_turn_every
    print(f"\ndamaged stores: each line of a session log damaged in turn, read back by proxy.capture.recovery; "
          f"--whole-turn-every {bound} (the default) beside none (deltas only)  [{load_average()}]")
    logs = {}
    for setting in ("none", str(bound)):
        proxy = ProxyProcess(engine, work / f"damage-store-{setting}", ["--whole-turn-every", setting])
        proxy.start()
        session_id, served = await _record(proxy, max(lengths))
        other = await _record(proxy, 5)  # beside it: it must come back intact whatever the damage
        proxy.stop()
        logs[setting] = (proxy.store / f"{session_id}.jsonl").read_bytes().splitlines(keepends=True), served
    print(f"  {'':<15} {'':>5} {'':>11} {'turns lost per damaged line':^31}")
    print(f"  {'damage':<15} {'turns':>5} {'lines tried':>11} {'max':>5} {'median':>6} {'mean':>5} {'bound':>5} "
          f"{'max, none':>9} {'mean, none':>10} {'served exact':>12}")
    for damage in DAMAGE:
        for length in lengths:
            costs, all_exact = _costs(*logs[str(bound)], damage, length, work)
            unbounded, none_exact = _costs(*logs["none"], damage, length, work)
            print(f"  {damage:<15} {length:>5} {len(costs):>11} {max(costs):>5} {statistics.median(costs):>6g} "
                  f"{statistics.mean(costs):>5.2f} {bound:>5} {max(unbounded):>9} {statistics.mean(unbounded):>10.2f} "
                  f"{'yes' if all_exact and none_exact else 'NO':>12}")
    await _restarted(proxy, session_id, served, other, work)  # the default's store


async def _restarted(recorded: ProxyProcess, victim: str, served: list[dict[str, Any]],
                     other: tuple[str, list[dict[str, Any]]], work: Path) -> None:
    """End to end at 19 turns: the worst line (turn 8, logged whole) damaged, a real proxy restarted on the store."""
    print(f"  restarted proxy, the log cut to {RESTARTED} turns, turn 8's line (a whole one) damaged; a 5-turn session "
          "beside it:")
    print(f"  {'damage':<15} {'trace':>5} {'served':>7} {'exact':>5} {'lost':>4} {'quarant.':>8} {'dupl.':>5} "
          f"{'file':<22} {'other session':<13}")
    exact = {t["node_id"]: _comparable(t) for t in served}
    other_id, other_turns = other
    for name, (how, _) in DAMAGE.items():
        copy = work / f"damaged-{len(name)}-{time.monotonic_ns()}"
        shutil.copytree(recorded.store, copy)
        log = copy / f"{victim}.jsonl"
        damaged = b"".join(how(log.read_bytes().splitlines(keepends=True)[:RESTARTED + 1], 9))
        log.write_bytes(damaged)
        again = ProxyProcess(recorded.engine, copy)
        again.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            status, trace = await fetch_trace(http, again.url, victim)
            recovery = (await health(http, again.url))["recovery"]
            _, other_trace = await fetch_trace(http, again.url, other_id)
        again.stop()
        served = trace.get("turns", [])
        all_exact = all(exact.get(t["node_id"]) == _comparable(t) for t in served)
        after = log.read_bytes()
        file = "unchanged" if after == damaged else "+ newline (torn end)" if after == damaged + b"\n" else "REWRITTEN"
        intact = "intact" if [_comparable(t) for t in other_trace["turns"]] == [_comparable(t)
                                                                                 for t in other_turns] else "CHANGED"
        print(f"  {name:<15} {status:>5} {len(served):>4}/{RESTARTED} {'yes' if all_exact else 'NO':>5} "
              f"{recovery['lost_turns']:>4} {recovery['quarantined_lines']:>8} {recovery['duplicate_lines']:>5} "
              f"{file:<22} {intact:<13}")


# ---------------------------------------------------------------------------------------------- chain cost


async def chain_cost(engine: str, work: Path, lengths: list[int], bounds: list[str]) -> None:
    """Bytes per turn of sessions of `lengths` turns (50, 200) for each --whole-turn-every of `bounds` (none first)."""
    print(f"\nwhat the damage bound costs on disk (bytes per turn of one session's log)  [{load_average()}]")
    print(f"  {'--whole-turn-every':>18}" + "".join(f"{f'{n} turns':>11}" for n in lengths)
          + "".join(f"{f'x none ({n})':>13}" for n in lengths))
    unbounded: dict[int, float] = {}
    for k in bounds:
        proxy = ProxyProcess(engine, work / f"chain-{k}", ["--whole-turn-every", k])
        proxy.start()
        sizes = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for turns in lengths:
                info = await new_session(http, proxy.url)
                messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM * 180},
                                                  {"role": "user", "content": "Fix it. " * 120}]
                for i in range(turns):
                    content = await chat(http, info["openai_base_url"], info["key"], messages, stream=False)
                    messages += [{"role": "assistant", "content": content},
                                 {"role": "user", "content": f"tool output {i}: " + "line of output text\n" * 100}]
                sizes[turns] = (proxy.store / f"{info['id']}.jsonl").stat().st_size / turns
        proxy.stop()
        if k == "none":
            unbounded = dict(sizes)
        print(f"  {k:>18}" + "".join(f"{sizes[n]:>11,.0f}" for n in lengths)
              + "".join(f"{sizes[n] / unbounded[n]:>12.2f}x" for n in lengths))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("damage", "chain"), action="append",
                        help="run only these sections (repeatable; default: all)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help=f"turns of the damaged logs (the longest at least {RESTARTED})")
    parser.add_argument("--chain-turns", default="50,200", help="turns of the sessions measured")
    parser.add_argument("--chain-bounds", default="none,32,16,8,4", help="the --whole-turn-every values compared")
    args = parse_args(parser, {"lengths": "10,19", "chain_turns": "10,20", "chain_bounds": "none,8"})
    lengths, chain_turns = [int(n) for n in args.lengths.split(",")], [int(n) for n in args.chain_turns.split(",")]
    bounds = ["none", *(k for k in args.chain_bounds.split(",") if k != "none")]  # the ratios' base first
    if max(lengths) < RESTARTED:
        parser.error(f"--lengths: the longest log must have at least {RESTARTED} turns")
    print(f"store bench: {os.cpu_count()} CPUs, {load_average()}")
    engine_process, engine = start_engine()
    try:
        with tempfile.TemporaryDirectory(prefix="store-") as tmp:
            only = set(args.only or ("damage", "chain"))
            if "damage" in only:
                await damaged_stores(engine, Path(tmp), lengths)
            if "chain" in only:
                await chain_cost(engine, Path(tmp), chain_turns, bounds)
    finally:
        engine_process.kill()
    print(f"\ndone  [{load_average()}]")


if __name__ == "__main__":
    asyncio.run(main())
