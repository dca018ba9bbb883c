"""Chaos for the proxy: kill -9 under load, and stalled connections (damaged stores: store_bench.py).

Everything runs against `harness-rl serve proxy` processes in front of the fast fake engine
(tests/fake_engine.py, its own process, answers in well under 1 ms; its chat route). Figures printed:

  kill -9        32 concurrent agents (16 streaming) converse with the proxy; at a random moment it is
                 killed with SIGKILL and restarted on the same store, 5 rounds. Per round: turns the
                 agents had acknowledged so far, how many of those the restarted proxy serves exactly
                 (target: all), turns recorded but never acknowledged (the kill came between the write
                 and the reply), lost and quarantined counts from /health, and the restart time
  stalled        1,000 connections that stall (400 send nothing, 400 half a request head, 200 half a
                 body; from a process of their own) against --header-timeout-s 2 --body-timeout-s 2,
                 while 8 agents keep calling (50 ms between calls): when each stalled connection is
                 closed, and the agents' p50/p99 latency beside a run without stalls (3 repeats, medians)

Run: `.venv/bin/python benchmarks/chaos_bench.py [--quick]` (about three minutes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from conventions import load_average, parse_args

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ADMIN_TOKEN = "chaos-bench-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
THINK_S = 0.05  # an agent's pause between calls in the stalled-connection runs (agents run tools between calls)
SYSTEM = "You are a careful coding agent. Follow the repository's conventions. "


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_engine() -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen([PYTHON, str(ROOT / "tests" / "fake_engine.py")], stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, process.stdout.readline().decode().strip()


@dataclass
class ProxyProcess:
    """`harness-rl serve proxy` on a fixed port and store, started, killed and restarted at will."""

    engine: str
    store: Path
    flags: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start and wait until it answers; the seconds that took (recovery included)."""
        began = time.monotonic()
        log = (self.store.parent / f"proxy-{self.port}.log").open("ab")
        self.process = subprocess.Popen(
            [PYTHON, "-m", "harness_rl.cli", "serve", "proxy", "--upstream", self.engine, "--port", str(self.port),
             "--store", str(self.store), "--no-engine-check", *self.flags],
            env={**os.environ, "HARNESS_RL_ADMIN_TOKEN": ADMIN_TOKEN}, stdout=subprocess.PIPE, stderr=log)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        if "harness-rl proxy on" not in line:
            raise RuntimeError(f"the proxy did not start: {line!r}")
        return time.monotonic() - began

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


async def new_session(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.post(f"{url}/sessions", json={}, headers=ADMIN) as resp:
        assert resp.status == 201, await resp.text()
        return dict(await resp.json())


async def fetch_trace(http: aiohttp.ClientSession, url: str, session_id: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{url}/sessions/{session_id}/trace", headers=ADMIN) as resp:
        return resp.status, (await resp.json() if resp.status == 200 else {"error": await resp.text()})


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/health") as resp:
        return dict(await resp.json())


async def chat(http: aiohttp.ClientSession, base: str, key: str, messages: list[dict[str, Any]],
               stream: bool) -> str | None:
    """One call; the answer's text if the agent received all of it (a stream through `[DONE]`), else None."""
    body = {"model": "policy", "messages": messages, "stream": stream}
    async with http.post(f"{base}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            await resp.read()
            return None
        if not stream:
            return str((await resp.json())["choices"][0]["message"]["content"])
        text: list[str] = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return "".join(text)
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return None
                text += [c["delta"].get("content") or "" for c in event["choices"]]
        return None


# ------------------------------------------------------------------------------------------------ kill -9


@dataclass
class ChaosAgent:
    """One agent conversing as long as `go` is set; it counts the turns it received whole."""

    session: dict[str, Any]
    stream: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    acked: Counter[tuple[int, str]] = field(default_factory=Counter)
    in_flight: bool = False

    async def run(self, http: aiohttp.ClientSession, go: asyncio.Event) -> None:
        self.messages = [{"role": "system", "content": SYSTEM * 20}, {"role": "user", "content": "start"}]
        while True:
            await go.wait()
            self.in_flight = True
            try:
                content = await chat(http, self.session["openai_base_url"], self.session["key"], self.messages,
                                     self.stream)
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                content = None
            finally:
                self.in_flight = False
            if content is None:
                await asyncio.sleep(0.05)
                continue
            self.acked[(len(self.messages), content)] += 1
            self.messages += [{"role": "assistant", "content": content},
                              {"role": "user", "content": f"go on ({len(self.messages)})"}]


async def kill_rounds(engine: str, work: Path, rounds: int, agents_n: int, rng: random.Random) -> None:
    print(f"\nkill -9 under {agents_n} concurrent agents ({agents_n // 2} streaming), {rounds} rounds  "
          f"[{load_average()}]")
    proxy = ProxyProcess(engine, work / "kill-store")
    proxy.start()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        agents = [ChaosAgent(await new_session(http, proxy.url), stream=i % 2 == 1) for i in range(agents_n)]
        go = asyncio.Event()
        tasks = [asyncio.create_task(agent.run(http, go)) for agent in agents]
        print(f"  {'round':>5} {'killed after':>12} {'acknowledged':>12} {'recovered':>9} {'unacked extra':>13} "
              f"{'lost':>4} {'quarantined':>11} {'restart s':>9}")
        rows = []
        for round_no in range(1, rounds + 1):
            go.set()
            alive = rng.uniform(0.5, 3.0)
            await asyncio.sleep(alive)
            proxy.kill9()
            go.clear()
            while any(agent.in_flight for agent in agents):
                await asyncio.sleep(0.01)
            restart_s = proxy.start()
            recovery = (await health(http, proxy.url))["recovery"]
            acknowledged = recovered = recorded = 0
            for agent in agents:
                status, trace = await fetch_trace(http, proxy.url, agent.session["id"])
                assert status == 200, trace
                traced = Counter((len(t["request"]["messages"]), t["reply"]["content"]) for t in trace["turns"])
                acknowledged += sum(agent.acked.values())
                recovered += sum(min(n, traced[k]) for k, n in agent.acked.items())
                recorded += len(trace["turns"])
            rows.append((acknowledged, recovered, restart_s))
            print(f"  {round_no:>5} {alive:>11.2f}s {acknowledged:>12} {recovered:>9} {recorded - recovered:>13} "
                  f"{recovery['lost_turns']:>4} {recovery['quarantined_lines']:>11} {restart_s:>9.2f}")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    proxy.stop()
    missing = [a - r for a, r, _ in rows]
    print(f"  acknowledged turns not recovered, per round: {missing} (target all 0); median restart "
          f"{statistics.median(r for _, _, r in rows):.2f} s  [{load_average()}]")


# ---------------------------------------------------------------------------------------- stalled connections


# The stalled connections come from a process of their own, so the agents' client is not slowed by them.
STALLER = """
import asyncio, json, sys, time
url, body_head, half_head = sys.argv[1], sys.argv[2].encode(), sys.argv[3].encode()
async def stall(kind):
    host, port = url.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return float("inf")
    began = time.monotonic()
    if kind != "silent":
        writer.write(body_head if kind == "body" else half_head)
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass
    writer.close()
    return time.monotonic() - began
async def main():
    kinds = ["silent"] * 400 + ["head"] * 400 + ["body"] * 200
    print(json.dumps(await asyncio.gather(*(stall(k) for k in kinds))), flush=True)
asyncio.run(main())
"""


async def _agent_calls(http: aiohttp.ClientSession, info: dict[str, Any], until: Callable[[], bool],
                       latencies: list[float]) -> None:
    """Calls of one agent, THINK_S apart, until `until()`; each call's latency appended."""
    messages = [{"role": "user", "content": "ping"}]
    while not until():
        began = time.perf_counter()
        content = await chat(http, info["openai_base_url"], info["key"], messages, stream=False)
        latencies.append(time.perf_counter() - began)
        assert content is not None
        await asyncio.sleep(THINK_S)


async def stalled_connections(engine: str, work: Path, repeats: int) -> None:
    timeout_s = 2.0
    print(f"\nstalled connections: 1,000 held (400 silent, 400 half a head, 200 half a body), header and body "
          f"timeouts {timeout_s:g} s, 8 agents calling  [{load_average()}]")
    proxy = ProxyProcess(engine, work / "stall-store", ["--header-timeout-s", str(timeout_s), "--body-timeout-s",
                                                        str(timeout_s), "--max-connections-per-client", "4096",
                                                        "--max-connections", "8192"])
    proxy.start()
    figures: dict[str, list[float]] = {"base p50": [], "base p99": [], "stall p50": [], "stall p99": [],
                                       "closed": [], "slowest close": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        infos = [await new_session(http, proxy.url) for _ in range(8)]
        body_head = (f"POST /s/{infos[0]['id']}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Type: application/json\r\nAuthorization: Bearer {infos[0]['key']}\r\n"
                     f"Content-Length: 4096\r\n\r\n{{\"model\":").encode()
        half_head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
        for repeat in range(repeats):
            base: list[float] = []
            end = time.monotonic() + 3.0

            def elapsed(end: float = end) -> bool:
                return time.monotonic() > end

            await asyncio.gather(*(_agent_calls(http, info, elapsed, base) for info in infos))
            staller = await asyncio.create_subprocess_exec(
                PYTHON, "-c", STALLER, proxy.url, body_head.decode(), half_head.decode(),
                stdout=asyncio.subprocess.PIPE)
            during: list[float] = []

            def all_closed(process: asyncio.subprocess.Process = staller) -> bool:
                return process.returncode is not None

            calls = asyncio.gather(*(_agent_calls(http, info, all_closed, during) for info in infos))
            assert staller.stdout is not None
            stalls: list[float] = json.loads(await staller.stdout.readline())
            await staller.wait()
            await calls
            figures["base p50"].append(quantile(base, 0.5) * 1000)
            figures["base p99"].append(quantile(base, 0.99) * 1000)
            figures["stall p50"].append(quantile(during, 0.5) * 1000)
            figures["stall p99"].append(quantile(during, 0.99) * 1000)
            figures["closed"].append(sum(s < float("inf") for s in stalls))
            figures["slowest close"].append(max(stalls))
            print(f"  repeat {repeat + 1}: {int(figures['closed'][-1])}/1000 closed, the slowest after "
                  f"{max(stalls):.2f} s; agents p50/p99 {figures['stall p50'][-1]:.1f}/{figures['stall p99'][-1]:.1f} "
                  f"ms ({len(during)} calls) vs {figures['base p50'][-1]:.1f}/{figures['base p99'][-1]:.1f} ms "
                  f"without stalls ({len(base)} calls)")
    proxy.stop()
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"  medians: closed {med['closed']:.0f}/1000, slowest close {med['slowest close']:.2f} s (timeout "
          f"{timeout_s:g} s); agents p99 {med['stall p99']:.1f} ms with stalls vs {med['base p99']:.1f} ms without "
          f"(target < 100 ms); p50 {med['stall p50']:.1f} vs {med['base p50']:.1f} ms  [{load_average()}]")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the stalled-connection run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("kill", "stalled"), action="append",
                        help="run only these sections (repeatable; default: all)")
    args = parse_args(parser, {"rounds": 1, "agents": 4, "repeats": 1})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536, hard))
    print(f"chaos bench: {os.cpu_count()} CPUs, {load_average()}")
    engine_process, engine = start_engine()
    try:
        with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
            work = Path(tmp)
            only = set(args.only or ("kill", "stalled"))
            if "kill" in only:
                await kill_rounds(engine, work, args.rounds, args.agents, random.Random(args.seed))
            if "stalled" in only:
                await stalled_connections(engine, work, args.repeats)
    finally:
        engine_process.kill()
    print(f"\ndone  [{load_average()}]")


if __name__ == "__main__":
    asyncio.run(main())
