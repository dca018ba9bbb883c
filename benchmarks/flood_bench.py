"""20,000 stalled connections from one address, against the proxy's default limits: is everyone else served?

A `harness-rl serve proxy` process (default limits: 1,024 connections per client, 4,096 in all, 30 s
header timeout) in front of the fast fake engine (tests/fake_engine.py). Two flooding processes on
127.0.0.1 open 10,000 connections each as fast as they can, half of them silent and half sending
half a request head, and hold every one until the proxy closes it. Meanwhile, from the same address,
8 agents of other sessions keep calling (4 on a new connection per call, 4 on kept-alive ones; 50 ms
between calls) and the trainer keeps creating sessions (`POST /sessions`, a new connection each).

Printed per repeat, and as medians of 3: how many agent calls and session creations were answered
200/201 during the flood (target: all), their p50/p99 latency beside a run without the flood, the
most file descriptors and connections the proxy held (sampled every 20 ms from /proc), the flood's
connections closed to make room at accept or refused there, and how long the flood took.

Run: `.venv/bin/python benchmarks/flood_bench.py [--repeats 3] [--connections 20000] [--quick]` (about two minutes
on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from chaos_bench import ADMIN, PYTHON, ProxyProcess, chat, health, new_session, quantile, start_engine
from conventions import load_average, parse_args

FLOOD = 20_000
FLOODERS = 2
THINK_S = 0.05

# One flooding process: its share of the connections, opened one after another, each held until the proxy
# closes it; prints how many opened, how many the proxy closed, and the seconds opening them took.
FLOODER = """
import asyncio, json, sys, time
url, count = sys.argv[1], int(sys.argv[2])
host, port = url.removeprefix("http://").split(":")
HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: appl"
async def hold(reader, writer, closed):
    try:
        while await reader.read(65536):
            pass
        closed.append(1)
    except ConnectionError:
        closed.append(1)
    writer.close()
async def main():
    began, opened, failed, closed, holders = time.monotonic(), 0, 0, [], []
    for i in range(count):
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            failed += 1
            continue
        opened += 1
        if i % 2:
            writer.write(HALF_HEAD)
        holders.append(asyncio.ensure_future(hold(reader, writer, closed)))
    took = time.monotonic() - began
    await asyncio.sleep(1.0)  # the last ones' fate
    print(json.dumps({"opened": opened, "failed": failed, "closed": len(closed), "seconds": took}), flush=True)
    for task in holders:
        task.cancel()
asyncio.run(main())
"""


async def _calls(http: aiohttp.ClientSession, info: dict[str, Any], until: Callable[[], bool],
                 outcome: dict[str, list[float]]) -> None:
    """One agent's calls until `until()`: the latency of each answered one, the time of each failed one."""
    messages = [{"role": "user", "content": "ping"}]
    while not until():
        began = time.perf_counter()
        try:
            content = await chat(http, info["openai_base_url"], info["key"], messages, stream=False)
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            content = None
        outcome["ok" if content is not None else "failed"].append(time.perf_counter() - began)
        await asyncio.sleep(THINK_S)


async def _creations(http: aiohttp.ClientSession, url: str, until: Callable[[], bool],
                     outcome: dict[str, list[float]]) -> None:
    """The trainer creating sessions until `until()`, each on a new connection."""
    while not until():
        began = time.perf_counter()
        try:
            async with http.post(f"{url}/sessions", json={}, headers=ADMIN) as resp:
                await resp.read()
                ok = resp.status == 201
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            ok = False
        outcome["ok" if ok else "failed"].append(time.perf_counter() - began)
        await asyncio.sleep(0.1)


async def _sample(pid: int, until: Callable[[], bool], fds: list[int]) -> None:
    while not until():
        try:
            fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        except OSError:
            pass
        await asyncio.sleep(0.02)


async def _round(proxy: ProxyProcess, sessions: list[dict[str, Any]], fresh: aiohttp.ClientSession,
                 kept: aiohttp.ClientSession, flood: int) -> dict[str, Any]:
    """Agents and the trainer calling for 3 s (without a flood) or until a flood of `flood` connections has run its
    course."""
    outcomes = {kind: {"ok": [], "failed": []} for kind in ("fresh", "kept", "sessions")}
    fds: list[int] = []
    flooders: list[asyncio.subprocess.Process] = []
    if flood:
        flooders = [await asyncio.create_subprocess_exec(PYTHON, "-c", FLOODER, proxy.url, str(flood // FLOODERS),
                                                         stdout=asyncio.subprocess.PIPE) for _ in range(FLOODERS)]
        end = float("inf")
    else:
        end = time.monotonic() + 3.0

    def over() -> bool:
        return time.monotonic() > end or (bool(flooders) and all(f.returncode is not None for f in flooders))

    assert proxy.process is not None
    work = asyncio.gather(*(_calls(fresh if i < 4 else kept, info, over, outcomes["fresh" if i < 4 else "kept"])
                            for i, info in enumerate(sessions)),
                          _creations(fresh, proxy.url, over, outcomes["sessions"]),
                          _sample(proxy.process.pid, over, fds))
    reports = []
    for flooder in flooders:
        assert flooder.stdout is not None
        reports.append(json.loads(await flooder.stdout.readline()))
        await flooder.wait()
    await work
    return {"outcomes": outcomes, "fds": max(fds), "flood": reports}


def _line(kind: str, outcome: dict[str, list[float]]) -> str:
    ok, failed = outcome["ok"], outcome["failed"]
    return (f"{kind} {len(ok)}/{len(ok) + len(failed)} ok, p50/p99 {quantile(ok, 0.5) * 1000:.1f}/"
            f"{quantile(ok, 0.99) * 1000:.1f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connections", type=int, default=FLOOD, help="stalled connections in each flood")
    args = parse_args(parser, {"repeats": 1, "connections": 2 * 1024 + 2})  # still past the per-client limit
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"flood bench: {args.connections:,} stalled connections from 127.0.0.1 ({FLOODERS} processes), "
          f"{os.cpu_count()} CPUs, open-file limit {hard}, {load_average()}")
    engine_process, engine = start_engine()
    figures: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="flood-") as tmp:
            proxy = ProxyProcess(engine, Path(tmp) / "store")
            proxy.start()
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) \
                    as fresh, aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as kept:
                sessions = [await new_session(kept, proxy.url) for _ in range(8)]
                for repeat in range(args.repeats):
                    base = await _round(proxy, sessions, fresh, kept, flood=0)
                    during = await _round(proxy, sessions, fresh, kept, flood=args.connections)
                    counters = await health(kept, proxy.url)
                    flood = during["flood"]
                    answered = {k: len(o["ok"]) / max(1, len(o["ok"]) + len(o["failed"]))
                                for k, o in during["outcomes"].items()}
                    print(f"  repeat {repeat + 1}  [{load_average()}]")
                    print(f"    flood: {sum(f['opened'] for f in flood):,} opened ({sum(f['failed'] for f in flood)} "
                          f"failed to connect) in {max(f['seconds'] for f in flood):.1f} s, "
                          f"{sum(f['closed'] for f in flood):,} closed by the proxy; the proxy held at most "
                          f"{during['fds']} fds ({base['fds']} without the flood); so far "
                          f"{counters['connections_evicted']:,} idle unknown connections closed to make room, "
                          f"{counters['connections_refused']:,} refused at accept")
                    for kind in ("fresh", "kept", "sessions"):
                        print(f"    during: {_line(kind, during['outcomes'][kind])}   without: "
                              f"{_line(kind, base['outcomes'][kind])}")
                        figures.setdefault(f"{kind} answered", []).append(answered[kind])
                        figures.setdefault(f"{kind} p99", []).append(quantile(during["outcomes"][kind]["ok"], 0.99))
                        figures.setdefault(f"{kind} base p99", []).append(
                            quantile(base["outcomes"][kind]["ok"], 0.99))
                    figures.setdefault("fds", []).append(during["fds"])
            proxy.stop()
    finally:
        engine_process.kill()
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"  medians of {args.repeats}: answered during the flood: agents on new connections "
          f"{med['fresh answered']:.1%}, on kept-alive ones {med['kept answered']:.1%}, POST /sessions "
          f"{med['sessions answered']:.1%} (target 100%); p99 {med['fresh p99'] * 1000:.0f} / "
          f"{med['kept p99'] * 1000:.0f} / {med['sessions p99'] * 1000:.0f} ms vs {med['fresh base p99'] * 1000:.0f} / "
          f"{med['kept base p99'] * 1000:.0f} / {med['sessions base p99'] * 1000:.0f} ms without; the proxy held at "
          f"most {med['fds']:.0f} fds  [{load_average()}]")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
