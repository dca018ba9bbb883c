"""Proxy overhead, side by side in one run: the engine directly, OpenEnv's capture proxy, and ours.

All three talk to the same fast fake engine (tests/fake_engine.py, its own process, answers in well
under 1 ms) with agent-sized requests: ~20 messages, ~16 KB, 10 tool schemas, ~5k prompt tokens.
Each proxy runs in its own process under the same small wrapper that times every garbage
collection. Figures printed:

  one agent      p50/p99 latency over the first 50 sequential turns of a session, and what is added:
                 each target alone, and all three interleaved turn by turn (outside load falls on each
                 alike, but each proxy's background work also slows the others)
  session length one session of 400 turns per target, alone: mean latency of turns 1-50 vs 351-400,
                 the slope per 100 turns held, and the proxy's CPU per request early and late
  proxy CPU      user+system CPU the proxy process spent per request (unaffected by other load)
  memory         RSS growth per captured turn over those 400 turns
  saturation     requests/s with 32 agents sending back to back for a few seconds
  64 agents      p50/p99 latency, 64 agents with 500 ms think time between turns, and what is added
  collector      gen-2 collections and the longest collector pause (wall, and the collector's own CPU)
  echo           bytes the agent receives per answer, and whether capture fields leak to it
  splice         an agent that sends its own replies back (a conversation growing to 400 turns), through
                 our proxy with token in/token out on and off, interleaved: what splicing adds per turn,
                 early and late, and the proxy CPU per turn in each mode

Run: `.venv/bin/python benchmarks/proxy_bench.py` (about three minutes on a 2-core machine; other load on
the machine moves the latency figures, the CPU-per-request figures much less).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Runs a module as __main__ and appends every gen-2 collection and every pause over 1 ms to $GC_STATS
# as "generation wall-seconds cpu-seconds wall-time" lines, as they happen (so a killed process still
# reports). CPU seconds tell the collector's own work apart from time the process was descheduled.
GC_WRAPPER = """
import gc, os, runpy, sys, time
out = open(os.environ["GC_STATS"], "a", buffering=1)
started = [0.0, 0.0]
def timed(phase, info):
    if phase == "start":
        started[:] = time.perf_counter(), time.process_time()
        return
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    if info["generation"] == 2 or wall > 0.001:
        out.write(f"{info['generation']} {wall} {cpu} {time.time()}\\n")
gc.callbacks.append(timed)
module = sys.argv[1]
sys.argv = [module] + sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def tool_schemas() -> list[dict]:
    names = ["bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "webfetch", "write"]
    return [{"type": "function", "function": {
        "name": name, "description": f"The {name} tool. " + "Use it carefully and only when needed. " * 3,
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Absolute path of the file to work on."},
            "content": {"type": "string", "description": "Text to write, or the pattern to look for."},
            "timeout": {"type": "integer", "description": "Seconds before giving up."}},
            "required": ["path"]}}} for name in names]


def history() -> list[dict]:
    """An agent's conversation of 19 messages (~15 KB) before its latest user message."""
    out: list[dict] = [{"role": "system", "content": "You are a careful coding agent. " * 60},
                       {"role": "user", "content": "Fix the failing test in the repository. " * 20}]
    for i in range(8):
        call_id = f"call_{i}"
        out.append({"role": "assistant", "content": f"Step {i}: let me inspect the code.",
                    "tool_calls": [{"id": call_id, "type": "function",
                                    "function": {"name": "read", "arguments": json.dumps({"path": f"/src/m{i}.py"})}}]})
        out.append({"role": "tool", "tool_call_id": call_id, "content": f"def f{i}(x):\n    return x + {i}\n" * 30})
    out.append({"role": "assistant", "content": "I have read enough to propose a fix. " * 10})
    return out


HISTORY, TOOLS = history(), tool_schemas()


def agent_body(turn: int) -> bytes:
    messages = HISTORY + [{"role": "user", "content": f"Continue with step {turn}."}]
    return json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """User+system CPU seconds the process has used (robust to other load on the machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@dataclass
class Target:
    """One way for an agent to reach the engine."""

    name: str
    process: subprocess.Popen | None
    base: str
    kind: str  # direct | openenv | ours
    admin: dict[str, str] = field(default_factory=dict)
    gc_stats: Path | None = None

    async def session(self, http: aiohttp.ClientSession) -> tuple[str, dict[str, str]]:
        """(chat completions URL, headers) for a fresh agent."""
        if self.kind == "direct":
            return f"{self.base}/v1/chat/completions", {"Content-Type": "application/json"}
        async with http.post(f"{self.base}/sessions", json={}, headers=self.admin) as resp:
            info = await resp.json()
        if self.kind == "openenv":
            return f"{self.base}/v1/chat/completions", {"Authorization": f"Bearer {info['session_id']}",
                                                        "Content-Type": "application/json"}
        return f"{info['openai_base_url']}/chat/completions", {"Authorization": f"Bearer {info['key']}",
                                                               "Content-Type": "application/json"}


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60))


async def post(http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes) -> tuple[float, bytes]:
    started = time.perf_counter()
    async with http.post(url, data=body, headers=headers) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {data[:300]!r}")
    return time.perf_counter() - started, data


async def one_agent(targets: list[Target], turns: int) -> dict[str, dict]:
    """One session of `turns` sequential turns per target, interleaved turn by turn so that load from
    anything else on the machine falls on all targets alike."""
    async with client() as http:
        for target in targets:  # warm-up in a throwaway session
            url, headers = await target.session(http)
            for i in range(20):
                await post(http, url, headers, agent_body(i))
        sessions = [await target.session(http) for target in targets]
        before = [rss_kb(t.process.pid) if t.process else 0 for t in targets]
        cpu_before = [cpu_s(t.process.pid) if t.process else 0.0 for t in targets]
        latencies: list[list[float]] = [[] for _ in targets]
        sizes: list[list[int]] = [[] for _ in targets]
        last: list[bytes] = [b""] * len(targets)
        cpu_marks: dict[int, list[float]] = {}
        for turn in range(turns):
            if turn in (100, turns - 100):
                cpu_marks[turn] = [cpu_s(t.process.pid) if t.process else 0.0 for t in targets]
            body = agent_body(turn)
            for k, (url, headers) in enumerate(sessions):
                latency, last[k] = await post(http, url, headers, body)
                latencies[k].append(latency)
                sizes[k].append(len(last[k]))
        after = [rss_kb(t.process.pid) if t.process else 0 for t in targets]
        cpu_after = [cpu_s(t.process.pid) if t.process else 0.0 for t in targets]
    out = {}
    for k, target in enumerate(targets):
        answer = json.loads(last[k])
        choice = answer["choices"][0]
        leaked = sorted({"prompt_token_ids", "token_ids"} & (set(answer) | set(choice))
                        | ({"logprobs"} if choice.get("logprobs") is not None else set()))
        lat = latencies[k]
        out[target.name] = {
            "p50": statistics.median(lat[:50]), "p99": quantile(lat[:50], 0.99), "p50_all": statistics.median(lat),
            "first50": statistics.fmean(lat[:50]), "last50": statistics.fmean(lat[-50:]),
            "slope_per_100": statistics.linear_regression(range(turns), lat).slope * 100,
            "kb_per_turn": (after[k] - before[k]) / turns, "cpu": (cpu_after[k] - cpu_before[k]) / turns,
            "cpu_first100": (cpu_marks[100][k] - cpu_before[k]) / 100,
            "cpu_last100": (cpu_after[k] - cpu_marks[turns - 100][k]) / 100,
            "bytes": statistics.fmean(sizes[k]), "leaked": leaked}
    return out


async def saturate(target: Target, agents: int, seconds: float) -> float:
    async with client() as http:
        sessions = [await target.session(http) for _ in range(agents)]
        bodies = [agent_body(i) for i in range(50)]
        done = 0
        deadline = time.perf_counter() + seconds

        async def agent(url: str, headers: dict[str, str]) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < deadline:
                try:
                    await post(http, url, headers, bodies[i % 50])
                    done += 1
                except (TimeoutError, aiohttp.ClientError, RuntimeError):
                    pass
                i += 1

        started = time.perf_counter()
        await asyncio.gather(*(agent(u, h) for u, h in sessions))
        return done / (time.perf_counter() - started)


async def thinking_agents(target: Target, agents: int, think_s: float, seconds: float) -> list[float]:
    async with client() as http:
        sessions = [await target.session(http) for _ in range(agents)]
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def agent(k: int, url: str, headers: dict[str, str]) -> None:
            await asyncio.sleep(think_s * k / agents)  # spread the arrivals
            turn = 0
            while time.perf_counter() < deadline:
                try:
                    latency, _ = await post(http, url, headers, agent_body(turn))
                except (TimeoutError, aiohttp.ClientError, RuntimeError):
                    latency = 60.0  # counted as a 60 s answer
                latencies.append(latency)
                turn += 1
                await asyncio.sleep(think_s)

        await asyncio.gather(*(agent(k, u, h) for k, (u, h) in enumerate(sessions)))
        return latencies


async def splicing(targets: list[Target], turns: int) -> dict[str, dict[str, float]]:
    """One agent per target sending its own replies back, the conversation growing every turn; targets
    interleaved turn by turn. Per target: mean latency and proxy CPU of turns 1-50 and the last 50."""
    async with client() as http:
        sessions = [await target.session(http) for target in targets]
        conversations: list[list[dict]] = [[{"role": "system", "content": "You are a careful coding agent. " * 60},
                                            {"role": "user", "content": "Fix the failing test."}] for _ in targets]
        latencies: list[list[float]] = [[] for _ in targets]
        cpu: list[list[float]] = [[] for _ in targets]
        for turn in range(turns):
            for k, (url, headers) in enumerate(sessions):
                before = cpu_s(targets[k].process.pid) if targets[k].process else 0.0
                body = json.dumps({"model": "policy", "messages": conversations[k], "tools": TOOLS}).encode()
                latency, data = await post(http, url, headers, body)
                cpu[k].append((cpu_s(targets[k].process.pid) if targets[k].process else 0.0) - before)
                latencies[k].append(latency)
                reply = json.loads(data)["choices"][0]["message"]
                conversations[k] += [{key: reply[key] for key in ("role", "content", "tool_calls") if key in reply},
                                     {"role": "user", "content": f"Result of step {turn}: " + "ok " * 40}]
    return {t.name: {"first50": statistics.median(latencies[k][:50]), "last50": statistics.median(latencies[k][-50:]),
                     "cpu_first50": statistics.fmean(cpu[k][:50]), "cpu_last50": statistics.fmean(cpu[k][-50:]),
                     "slope_per_100": statistics.linear_regression(range(turns), latencies[k]).slope * 100}
            for k, t in enumerate(targets)}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_health(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def start_engine() -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([PYTHON, str(ROOT / "tests" / "fake_engine.py")], stdout=subprocess.PIPE)
    return process, process.stdout.readline().decode().strip()


def start_openenv(engine: str, work: Path) -> Target:
    port = free_port()
    stats = work / f"openenv-gc-{port}.json"
    process = subprocess.Popen(
        [PYTHON, "-c", GC_WRAPPER, "openenv.core.harness.capture.server", "--llm-url", engine, "--model", "fake",
         "--capture-level", "tokens", "--port", str(port)],
        env={**os.environ, "GC_STATS": str(stats)}, stdout=subprocess.DEVNULL,
        stderr=(work / f"openenv-{port}.log").open("wb"))  # its INFO log must never block on a full pipe
    url = f"http://127.0.0.1:{port}"
    wait_health(url, process)
    return Target("OpenEnv capture proxy", process, url, "openenv", gc_stats=stats)


def start_ours(engine: str, work: Path, *flags: str) -> Target:
    stats = work / f"ours-gc-{time.monotonic_ns()}.json"
    process = subprocess.Popen(
        [PYTHON, "-c", GC_WRAPPER, "harness_rl.cli", "serve", "proxy", "--upstream", engine, "--port", "0",
         "--store", str(work / "store"), "--no-engine-check", *flags],
        env={**os.environ, "GC_STATS": str(stats), "HARNESS_RL_ADMIN_TOKEN": "bench"}, stdout=subprocess.PIPE,
        stderr=(work / f"ours-{time.monotonic_ns()}.log").open("wb"))
    url = process.stdout.readline().decode().split()[3]
    wait_health(url, process)
    return Target("harness-rl proxy", process, url, "ours", admin={"Authorization": "Bearer bench"}, gc_stats=stats)


def stop(target: Target, since: float) -> list[tuple[int, float, float]]:
    """Stop the proxy; return (generation, wall, cpu) of the collections it ran from `since` until the stop
    signal (the interpreter's own collection at exit is no pause an agent sees)."""
    if target.process is None:
        return []
    until = time.time()
    target.process.send_signal(signal.SIGTERM)
    try:
        target.process.wait(20)
    except subprocess.TimeoutExpired:
        target.process.kill()
        target.process.wait()
    if target.gc_stats is None or not target.gc_stats.exists():
        return []
    rows = [line.split() for line in target.gc_stats.read_text().splitlines()]
    return [(int(g), float(wall), float(cpu)) for g, wall, cpu, at in rows if since <= float(at) < until]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=400, help="turns of the one-agent session (at least 200)")
    parser.add_argument("--saturation-s", type=float, default=5.0)
    parser.add_argument("--think-s", type=float, default=10.0, help="duration of the 64-agent run")
    args = parser.parse_args()
    body = agent_body(0)
    print(f"request: {len(json.loads(body)['messages'])} messages, {len(body) / 1024:.1f} KB, {len(TOOLS)} tools")

    engine_process, engine = start_engine()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        starters = {"direct to engine": None, "OpenEnv capture proxy": start_openenv, "harness-rl proxy": start_ours}

        def fresh(name: str) -> Target:
            """Each phase gets freshly started proxies, so no phase pays for another's backlog."""
            start = starters[name]
            return start(engine, work) if start else Target(name, None, engine, "direct")

        pauses: dict[str, list[tuple[int, float, float]]] = {name: [] for name in starters}
        targets = [fresh(name) for name in starters]
        since = time.time()
        results = asyncio.run(one_agent(targets, 200))  # interleaved: the one-agent latencies compare fairly
        for target in targets:
            pauses[target.name] += stop(target, since)
            print(f"{target.name}: one agent p50 {ms(results[target.name]['p50'])}", flush=True)
        for name, r in results.items():
            target = fresh(name)
            since = time.time()
            alone = asyncio.run(one_agent([target], args.turns))[name]  # alone: nobody else's growth leaks in
            pauses[name] += stop(target, since)
            for key in ("p50_all", "first50", "last50", "slope_per_100", "kb_per_turn", "cpu", "cpu_first100",
                        "cpu_last100"):
                r[key] = alone[key]
            r["p50_alone"], r["p99_alone"] = alone["p50"], alone["p99"]
            print(f"{name}: {args.turns}-turn session, {r['kb_per_turn']:.1f} KB/turn", flush=True)
            target = fresh(name)
            since = time.time()
            lat = asyncio.run(thinking_agents(target, 64, 0.5, args.think_s))
            pauses[name] += stop(target, since)
            r["think_p50"], r["think_p99"] = statistics.median(lat), quantile(lat, 0.99)
            print(f"{name}: 64 agents p50 {ms(r['think_p50'])} p99 {ms(r['think_p99'])}", flush=True)
            target = fresh(name)
            since = time.time()
            r["rps"] = asyncio.run(saturate(target, 32, args.saturation_s))
            pauses[name] += stop(target, since)
            print(f"{name}: saturation {r['rps']:.0f} req/s", flush=True)
            r["gen2"] = sum(1 for g, _, _ in pauses[name] if g == 2)
            r["max_pause"] = max((wall for _, wall, _ in pauses[name]), default=0.0)
            r["max_pause_cpu"] = max((cpu for _, _, cpu in pauses[name]), default=0.0)
        spliced = start_ours(engine, work)
        rendered = start_ours(engine, work, "--no-tito")
        rendered.name = "harness-rl proxy, --no-tito"
        splice = asyncio.run(splicing([spliced, rendered], args.turns))
        stop(spliced, time.time())
        stop(rendered, time.time())
    prompt_tokens = json.loads(direct_probe(engine))["usage"]["prompt_tokens"]
    engine_process.terminate()

    print(f"prompt: {prompt_tokens} tokens\n")
    direct = results["direct to engine"]
    names = list(results)
    rows = [
        ("one agent p50, alone", lambda r: ms(r["p50_alone"])),
        ("  added p50", lambda r: ms(r["p50_alone"] - direct["p50_alone"])),
        ("one agent p99, alone", lambda r: ms(r["p99_alone"])),
        ("one agent p50, interleaved", lambda r: ms(r["p50"])),
        ("  added p50", lambda r: ms(r["p50"] - direct["p50"])),
        ("one agent p99, interleaved", lambda r: ms(r["p99"])),
        (f"one agent p50 (1-{args.turns})", lambda r: ms(r["p50_all"])),
        ("turns 1-50 mean", lambda r: ms(r["first50"])),
        (f"turns {args.turns - 49}-{args.turns} mean", lambda r: ms(r["last50"])),
        ("  growth per 100 turns", lambda r: ms(r["slope_per_100"])),
        ("proxy CPU per request", lambda r: ms(r["cpu"])),
        ("  turns 1-100", lambda r: ms(r["cpu_first100"])),
        (f"  turns {args.turns - 99}-{args.turns}", lambda r: ms(r["cpu_last100"])),
        ("  one-core ceiling", lambda r: f"{1 / r['cpu']:7.0f} req/s" if r["cpu"] else "      -"),
        ("memory per captured turn", lambda r: f"{r['kb_per_turn']:7.1f} KB"),
        ("saturation (32 agents)", lambda r: f"{r['rps']:7.0f} req/s"),
        ("64 agents p50", lambda r: ms(r["think_p50"])),
        ("  added p50", lambda r: ms(r["think_p50"] - direct["think_p50"])),
        ("64 agents p99", lambda r: ms(r["think_p99"])),
        ("  added p99", lambda r: ms(r["think_p99"] - direct["think_p99"])),
        ("gen-2 collections", lambda r: f"{r['gen2']:7d}"),
        ("longest collector pause", lambda r: ms(r["max_pause"])),
        ("longest collector CPU time", lambda r: ms(r["max_pause_cpu"])),
        ("answer size to agent", lambda r: f"{r['bytes'] / 1024:7.1f} KB"),
    ]
    width = max(len(n) for n in names) + 2
    print(f"{'':28}" + "".join(f"{n:>{width}}" for n in names))
    for label, cell in rows:
        print(f"{label:28}" + "".join(f"{cell(results[n]):>{width}}" for n in names))
    for name in names:
        print(f"capture fields the agent receives via {name}: {', '.join(results[name]['leaked']) or 'none'}")
    on, off = splice["harness-rl proxy"], splice["harness-rl proxy, --no-tito"]
    print(f"\nsplice: an agent sending its own replies back, {args.turns} turns, token in/out on vs off, interleaved")
    print(f"{'':28}{'on (spliced)':>16}{'off (rendered)':>16}{'added':>12}")
    for label, key in (("p50 latency, turns 1-50", "first50"), ("p50 latency, last 50", "last50"),
                       ("proxy CPU, turns 1-50", "cpu_first50"), ("proxy CPU, last 50", "cpu_last50"),
                       ("latency growth per 100", "slope_per_100")):
        print(f"{label:28}{ms(on[key]):>16}{ms(off[key]):>16}{ms(on[key] - off[key]):>12}")
    ours, theirs = results["harness-rl proxy"], results["OpenEnv capture proxy"]
    print("\nratios (OpenEnv / ours): added p50 "
          f"{(theirs['p50_alone'] - direct['p50_alone']) / max(ours['p50_alone'] - direct['p50_alone'], 1e-9):.1f}x, "
          f"saturation {ours['rps'] / theirs['rps']:.1f}x (ours / OpenEnv), "
          f"memory per turn {theirs['kb_per_turn'] / max(ours['kb_per_turn'], 1e-9):.1f}x, "
          f"answer size {theirs['bytes'] / ours['bytes']:.1f}x")


def direct_probe(engine: str) -> str:
    import urllib.request

    request = urllib.request.Request(f"{engine}/v1/chat/completions", data=json.dumps(
        {**json.loads(agent_body(0)), "return_token_ids": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as resp:
        return resp.read().decode()


if __name__ == "__main__":
    main()
