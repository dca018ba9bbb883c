"""harness-rl sessions inside TRL's harness trainer (TRL 1.16, OpenEnv 0.10), judged by TRL's own code.

TRL turns a session's trace into training rows with `_turns_from_training_trace` and
`_chain_to_sequences` (lossless: `fork_threshold_tokens=0`, as its loop-owning worker sets it). On
hand-made capture trees, on random ones, and on the traces of real mini-swe-agent and opencode runs
(forced completions through the embedded engine), those rows are harness-rl's own rows
(`learner.rows.trace_rows`): one sequence per chain, every sampled agent token eligible exactly once,
the same tokens, masks and behaviour logprobs. The slow tests drive TRL's `_HarnessRolloutLoop` (the
rollout loop `HarnessRolloutWorker` runs in its child process) with our factory: it calls the factory
with its sampling policy, which starts the proxy, then `_run_session` runs a real CLI rollout and
returns it scored; a task whose verifier leaves no reward comes back with reward None, never 0.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from trace_strategies import traces

pytest.importorskip("openenv.core.harness")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "you are importing from trl.experimental"
    openenv_harness = pytest.importorskip("trl.experimental.async_grpo.openenv_harness")
from openenv.core.harness.capture.upstream import training_sampling  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import TrainingSequence, _chain_to_sequences  # noqa: E402

from adapters.tasks import Task, load_task, load_tasks  # noqa: E402
from harness_rl.integrations.trl import (  # noqa: E402
    TASK_TAG,
    HarnessRLSessionFactory,
    openenv_training_trace,
    proxy_sampling,
)
from harness_rl.learner.rows import Row, trace_rows  # noqa: E402
from harness_rl.run.stack import serve_proxy  # noqa: E402
from harness_rl.trace import Sampling, TrainingTrace, Turn  # noqa: E402
from proxy.config import ProxyConfig  # noqa: E402
from proxy.sampling import SamplingPolicy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "tasks"
AGENT_TASKS = ROOT / "examples" / "agent-tasks" / "train"
NOWHERE = "http://127.0.0.1:9"  # never contacted: factories are only started by the slow tests


def trl_sequences(trace: TrainingTrace, temperature: float | None = None) -> tuple[list[TrainingSequence],
                                                                                     dict[str, float]]:
    """What TRL's loop-owning worker makes of a session's trace: its own two functions, lossless."""
    turns = openenv_harness._turns_from_training_trace(openenv_training_trace(trace, temperature))
    return _chain_to_sequences(turns, "rollout", 0)


def as_row(sequence: TrainingSequence) -> tuple[list[int], list[int], list[float]]:
    """A TRL row as ours is kept: cut after its last trained token, logprobs only where trained."""
    end = max(i for i, m in enumerate(sequence.completion_mask) if m) + 1
    mask = sequence.completion_mask[:end]
    logprobs = [lp if m else 0.0 for lp, m in zip(sequence.old_log_probs[:end], mask, strict=True)]
    return sequence.input_ids[:end], mask, logprobs


def ours(rows: list[Row]) -> list[tuple[list[int], list[int], list[float]]]:
    return [(row.tokens, row.mask, row.logprobs) for row in rows]


def trained(rows: list[tuple[list[int], list[int], list[float]]]) -> Counter[tuple[tuple[int, ...], float]]:
    """Every trained position as (its tokens up to and including it, its behaviour logprob)."""
    return Counter((tuple(tokens[:i + 1]), logprobs[i]) for tokens, mask, logprobs in rows
                   for i, m in enumerate(mask) if m)


def turn(node_id: str, prompt: list[int], completion: list[int], *, parent: str | None = None,
         role: str = "agent", mask: list[int] | None = None, temperature: float | None = 1.0) -> Turn:
    return Turn(node_id=node_id, parent_id=parent, prompt_token_ids=prompt, completion_token_ids=completion,
                per_token_logps=[-0.125 * (i + 1) for i in range(len(completion))],
                loss_mask=[0] * len(prompt) + (mask if mask is not None else [1] * len(completion)),
                role=role, sampling=Sampling(temperature=temperature))  # type: ignore[arg-type]


# --- the reconciler on capture trees ----------------------------------------------------------------


def test_trl_rebuilds_our_rows_on_a_tree_with_a_fork_a_rewrite_a_retry_and_a_title() -> None:
    # Listed out of tree order (as late arrivals are): exported depth first, TRL's reconciler forks exactly where
    # our rows do; in this list's order it would fork once more (d before its parent b).
    trace = TrainingTrace(rollout_id="r", turns=[
        turn("title", [1, 2], [3], role="auxiliary"),
        turn("e", [30, 31], [32]),  # a rewritten history: a new root
        turn("d", [10, 11, 12, 13, 14, 15, 16, 21], [22, 23], parent="b", mask=[1, 0]),
        turn("a", [10, 11, 12], [13, 14]),
        turn("c", [10, 11, 12, 13, 14, 18], [19, 20], parent="a"),  # recorded before its sibling b: it continues a
        turn("b", [10, 11, 12, 13, 14, 15], [16], parent="a"),
        turn("retry", [10, 11, 12, 13, 14, 15], [17], parent="a", role="discarded"),
    ]).validate()
    expected = [([30, 31, 32], [0, 0, 1], [0.0, 0.0, -0.125]),
                ([10, 11, 12, 13, 14, 18, 19, 20], [0, 0, 0, 1, 1, 0, 1, 1], [0.0] * 3 + [-0.125, -0.25, 0.0]
                 + [-0.125, -0.25]),
                ([10, 11, 12, 13, 14, 15, 16, 21, 22], [0] * 6 + [1, 0, 1], [0.0] * 6 + [-0.125, 0.0, -0.125])]
    assert ours(trace_rows(trace)) == expected
    sequences, tally = trl_sequences(trace)
    assert [as_row(s) for s in sequences] == expected  # one sequence per chain: e, c, d
    assert tally["fork"] == 2 and tally["clean"] == 2 and tally["realign"] == 0
    exported = openenv_training_trace(trace)
    assert [t.node_id for t in exported.turns] == ["e", "a", "c", "b", "d"]  # depth first, agent turns only
    assert [t.metadata["harness_rl"].get("parent_id") for t in exported.turns] == [None, None, "a", "a", "b"]
    listed = [t.node_id for t in trace.turns]
    in_list_order = openenv_harness._turns_from_training_trace(openenv_harness.TrainingTrace(
        turns=sorted(exported.turns, key=lambda t: listed.index(t.node_id))))
    assert len(_chain_to_sequences(in_list_order, "rollout", 0)[0]) == 4  # e, d, a+c, b: depth first saves one


@settings(max_examples=150, deadline=None)
@given(traces())
def test_trl_trains_exactly_our_tokens_on_any_capture_tree(trace: TrainingTrace) -> None:
    sequences, _ = trl_sequences(trace)
    theirs = [(s.input_ids, s.completion_mask, s.old_log_probs) for s in sequences]
    theirs = [(tokens, mask, [lp if m else 0.0 for lp, m in zip(lps, mask, strict=True)])
              for tokens, mask, lps in theirs]
    assert trained(theirs) == trained(ours(trace_rows(trace)))
    eligible = sum(sum(t.completion_mask) for t in trace.turns if t.role == "agent")
    assert sum(sum(mask) for _, mask, _ in theirs) == eligible  # every sampled agent token exactly once


def test_a_turn_sampled_at_another_temperature_than_trls_is_refused() -> None:
    trace = TrainingTrace(rollout_id="r", turns=[turn("a", [1], [2], temperature=1.0)])
    assert openenv_training_trace(trace, 1.0).turns[0].node_id == "a"
    with pytest.raises(ValueError, match=r"sampled at temperature 1.0, but TRL trains at 0.7.*--temperature 0.7"):
        openenv_training_trace(trace, 0.7)


# --- the factory's settings ----------------------------------------------------------------------------


def test_trls_sampling_policy_is_pinned_at_the_proxy() -> None:
    # What TRL's loop-owning worker hands the factory for AsyncGRPOConfig(temperature=0.7): its defaults top_p=1.0,
    # top_k=0, repetition_penalty=1.0, through OpenEnv's own validator.
    trl_policy = training_sampling({"temperature": 0.7, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0})
    factory = HarnessRLSessionFactory(TASKS / "fix-off-by-one", engine_url=NOWHERE, sampling=trl_policy)
    assert factory.proxy.sampling == SamplingPolicy(temperature=0.7, truncation="neutralise")
    assert factory.temperature == 0.7
    rejecting = HarnessRLSessionFactory(TASKS / "fix-off-by-one", engine_url=NOWHERE, sampling=trl_policy,
                                        proxy=ProxyConfig(sampling=SamplingPolicy(truncation="reject")))
    assert rejecting.proxy.sampling == SamplingPolicy(temperature=0.7, truncation="reject")
    with pytest.raises(ValueError, match="top_p"):
        proxy_sampling({"temperature": 1.0, "top_p": 0.95})
    with pytest.raises(ValueError, match="temperature"):
        proxy_sampling({"temperature": 0.0})


def test_the_factory_is_built_like_harbors_and_refuses_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    factory = HarnessRLSessionFactory(AGENT_TASKS, engine_url=NOWHERE, harness="mini-swe-agent", max_turns=12,
                                      agent_timeout_s=300)
    assert (factory.rollouts.harness, factory.rollouts.max_turns, factory.rollouts.agent_timeout_s) == \
        ("mini-swe-agent", 12, 300)
    assert len(factory.tasks) == len(load_tasks(AGENT_TASKS)) == 24
    with pytest.raises(ValueError, match="engine_url .* or the proxy_url"):
        HarnessRLSessionFactory(AGENT_TASKS)
    with pytest.raises(ValueError, match="not both"):
        HarnessRLSessionFactory(AGENT_TASKS, engine_url=NOWHERE, proxy_url=NOWHERE, admin_token="t")
    monkeypatch.delenv("HARNESS_RL_ADMIN_TOKEN", raising=False)
    with pytest.raises(ValueError, match="admin token"):
        HarnessRLSessionFactory(AGENT_TASKS, proxy_url=NOWHERE)
    with pytest.raises(msgspec.ValidationError, match="max_turn"):
        HarnessRLSessionFactory(AGENT_TASKS, engine_url=NOWHERE, max_turn=3)


def test_prompts_name_their_task_and_the_factory_pickles_without_its_runtime() -> None:
    factory = HarnessRLSessionFactory(AGENT_TASKS, engine_url=NOWHERE)
    rows = factory.prompt_rows()
    assert [factory.task_for(row["prompt"]).name for row in rows] == [t.name for t in factory.tasks]
    assert rows[0]["prompt"][0] == {"role": "system", "content": TASK_TAG + rows[0]["task_name"]}
    assert factory.task_for(factory.tasks[3].instruction).name == factory.tasks[3].name  # a bare instruction
    with pytest.raises(KeyError, match="matches no task"):
        factory.task_for([{"role": "user", "content": "something else"}])
    twin = Task(name="twin", path=factory.tasks[0].path, instruction=factory.tasks[0].instruction)
    twins = HarnessRLSessionFactory([factory.tasks[0], twin], engine_url=NOWHERE)
    with pytest.raises(KeyError, match="instruction of 2 tasks"):
        twins.task_for(factory.tasks[0].instruction)
    assert twins.task_for(twins.prompt_rows()[1]["prompt"]).name == "twin"  # the name settles it
    copy = pickle.loads(pickle.dumps(factory))  # how TRL hands it to its rollout process
    assert copy._runtime is None and copy.rollouts == factory.rollouts and copy.proxy == factory.proxy
    assert [t.name for t in copy.tasks] == [t.name for t in factory.tasks]


def test_the_example_prints_what_it_would_train_with() -> None:
    """examples/trl_harness_trainer.py on a CPU box: --help, and --dry-run's configuration as JSON."""
    example = [sys.executable, str(ROOT / "examples" / "trl_harness_trainer.py")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = subprocess.run([*example, "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert shown.returncode == 0 and "--vllm-url" in shown.stdout and "HarnessRLSessionFactory" in shown.stdout
    dry = subprocess.run([*example, "--dry-run", "--vllm-url", "http://gpu-box:8000", "--tasks", str(AGENT_TASKS),
                          "--n-tasks", "3", "--temperature", "0.9"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    trainer, worker, factory = plan["AsyncGRPOConfig"], plan["HarnessRolloutWorker"], plan["HarnessRLSessionFactory"]
    assert (trainer["temperature"], trainer["top_p"], trainer["top_k"]) == (0.9, 1.0, -1)
    assert trainer["learning_rate"] == 1e-6 and trainer["max_staleness"] == 4
    assert trainer["vllm_server_base_url"] == worker["vllm_server_url"] == "http://gpu-box:8000"
    assert worker["harness_adapter"] is None and worker["rollout_reward_fn"] == "harbor_reward"
    assert factory["tasks"] == [t.name for t in load_tasks(AGENT_TASKS)[:3]]
    # one URL (or a list of them, where the proxy takes several engines)
    assert factory["capture"]["proxy"]["upstream"] in ("http://gpu-box:8000", ["http://gpu-box:8000"])
    assert factory["capture"]["proxy"]["sampling"] == factory["sampling"]["proxy"] == \
        {"temperature": 0.9, "truncation": "neutralise"}
    assert (factory["rollouts"]["harness"], factory["rollouts"]["max_turns"],
            factory["rollouts"]["max_tokens_per_turn"]) == ("mini-swe-agent", 12, 1024)


def test_the_examples_reward_is_the_guides() -> None:
    spec = importlib.util.spec_from_file_location("trl_harness_trainer", ROOT / "examples" / "trl_harness_trainer.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def reward(env_reward: float | None, tool_calls: int) -> float | None:
        return example.harbor_reward(openenv_harness.HarnessRolloutOutcome(
            env_reward=env_reward, completion=[], trace=[], tool_call_count=tool_calls, tool_failure_count=0,
            tool_calls_by_name={}, timed_out=False))

    assert reward(None, 3) is None
    assert reward(1.0, 3) == pytest.approx(1.0 + 0.3 * (1 - 3 / 15))
    assert reward(1.0, 20) == 1.0 and reward(0.0, 0) == 0.0 and reward(0.5, 0) == 0.5


# --- real agent CLIs through TRL's rollout loop ----------------------------------------------------------

GREETING = "printf 'hello harness-rl\\n' > greeting.txt"
FIX = "sed -i 's/range(n)/range(n + 1)/' mathlib.py"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def agent_clis() -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("npm/node are not installed: opencode cannot be installed")
    subprocess.run([str(ROOT / "scripts" / "install_agents.sh")], check=True, capture_output=True, timeout=900,
                   env={**os.environ, "PYTHON": sys.executable})


@pytest.fixture(scope="module")
def exact_engine_url(engine: Any) -> Iterator[str]:
    """The shared tiny engine served as vLLM is for capture (`token_id:N` logprob tokens), forced completions on."""
    from harness_rl.engine import serve_in_thread

    with serve_in_thread(engine, forced_completions=True, return_tokens_as_token_ids=True) as server:
        yield server.url


def force(url: str, tools: list[str], no_tools: Sequence[str] = ()) -> None:
    httpx.delete(f"{url}/forced_completions").raise_for_status()
    httpx.post(f"{url}/forced_completions", json={"tools": tools, "no_tools": list(no_tools)}).raise_for_status()


@pytest.fixture
def trl_loop(tiny_model_dir: Path, exact_engine_url: str) -> Iterator[Any]:
    """Build TRL's `_HarnessRolloutLoop` around a factory (as `HarnessRolloutWorker` does in its child)."""
    from accelerate.state import PartialState
    from transformers import AutoTokenizer
    from trl import chat_template_utils

    built: list[Any] = []

    def build(factory: HarnessRLSessionFactory, temperature: float = 1.0, **kwargs: Any) -> Any:
        PartialState()  # as TRL's child process does first: its loggers need it
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        # TRL parses replies only when it samples turns itself (white-box); a loop-owning worker never does, but its
        # constructor wants a response template, which it cannot infer for the tiny model's hermes-style template.
        tokenizer.response_template = chat_template_utils.qwen3_template
        context = multiprocessing.get_context("spawn")
        loop = openenv_harness._HarnessRolloutLoop(
            harness_session_factory=factory, model_name="tiny", dataset=factory.prompt_rows(), reward_funcs=[],
            processing_class=tokenizer, eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=context.Queue(),
            model_version_value=context.Value("i", 0), heartbeat_value=context.Value("d", 0.0),
            failed_event=context.Event(), exception_info_queue=context.Queue(), metrics_queue=context.Queue(),
            num_generations=2, max_inflight_tasks=2, temperature=temperature, top_p=1.0, top_k=0, **kwargs)
        built.append(loop)
        return loop

    yield build
    httpx.delete(f"{exact_engine_url}/forced_completions").raise_for_status()
    for loop in built:
        loop._session_pool.shutdown()
        loop._tool_pool.shutdown()
        loop._loop.close()
        loop._factory.close()


def cli_factory(task: Path, harness: str, **kwargs: Any) -> HarnessRLSessionFactory:
    sandbox_options = {"network": "proxy-only"} if shutil.which("bwrap") else {}
    return HarnessRLSessionFactory(task, harness=harness, max_tokens_per_turn=64, max_turns=12, agent_timeout_s=240,
                                   sandbox_options=sandbox_options, **kwargs)


def captured(loop: Any) -> TrainingTrace:
    """harness-rl's own trace of the one rollout the factory ran, read from its proxy."""
    runtime = loop._factory._runtime
    (session,) = runtime.loop.run(runtime.client.list_sessions())
    return runtime.loop.run(runtime.client.get_trace(session.id)).validate()


def assert_trl_trains_our_rows(sequences: list[TrainingSequence], trace: TrainingTrace, agent_turns: int) -> None:
    agents = [t for t in trace.turns if t.role == "agent"]
    assert len(agents) == agent_turns
    assert [as_row(s) for s in sequences] == ours(trace_rows(trace))
    (sequence,) = sequences  # the agent turns are one chain, token in, token out: one sequence
    trained_ids = [token for token, m in zip(sequence.input_ids, sequence.completion_mask, strict=True) if m]
    assert trained_ids == [token for t in agents for token in t.completion_token_ids]  # each exactly once


@pytest.mark.slow
def test_mini_swe_agent_rollout_through_trls_run_session(agent_clis: None, trl_loop: Any, exact_engine_url: str,
                                                         tmp_path: Path) -> None:
    factory = cli_factory(TASKS / "fix-off-by-one", "mini-swe-agent", engine_url=exact_engine_url,
                          proxy=ProxyConfig(store_dir=str(tmp_path / "store")))
    loop = trl_loop(factory)
    assert loop._factory is not factory and loop._factory.temperature == 1.0 and loop._fork_threshold_tokens == 0
    force(exact_engine_url, tools=[tool_call("bash", {"command": "cat mathlib.py"}),
                                   tool_call("bash", {"command": FIX}), tool_call("bash", {"command": SUBMIT})])
    (completion, completion_ids, sequences, tool_calls, tool_failures, reward), metrics = loop._run_session(
        factory.prompt_rows()[0]["prompt"], 7)
    assert reward == 1.0 and tool_calls == 3 and tool_failures == 0
    assert metrics["turns"] == 3 and metrics["tool_calls_by_name"] == {"bash": 3} and not metrics["loop_exhausted"]
    assert metrics["tally"]["clean"] == 2 and metrics["tally"]["fork"] == 0
    trace = captured(loop)
    assert trace.metadata["group_id"] == 7  # TRL's group id is the rollout's group
    assert_trl_trains_our_rows(sequences, trace, agent_turns=3)
    assert completion_ids == [token for t in trace.turns for token in t.completion_token_ids]
    assert completion[0]["role"] == "system" and completion[-1]["role"] == "assistant"


@pytest.mark.slow
def test_opencode_rollout_through_trls_run_session_at_trls_temperature(agent_clis: None, trl_loop: Any,
                                                                       exact_engine_url: str, tmp_path: Path) -> None:
    factory = cli_factory(TASKS / "write-greeting", "opencode", engine_url=exact_engine_url,
                          proxy=ProxyConfig(store_dir=str(tmp_path / "store")))
    loop = trl_loop(factory, temperature=0.8)
    force(exact_engine_url, tools=[tool_call("bash", {"command": GREETING, "description": "Write the greeting"}),
                                   tool_call("bash", {"command": "cat greeting.txt", "description": "Check it"}),
                                   "Done."], no_tools=["Greeting file"] * 3)
    prompt = factory.prompt_rows()[0]["prompt"]
    (completion, _, sequences, tool_calls, _, reward), metrics = loop._run_session(prompt, 0)
    assert reward == 1.0 and tool_calls == 2 and metrics["turns"] == 3  # the title call is not sent to TRL
    trace = captured(loop)
    assert sorted(t.role for t in trace.turns) == ["agent", "agent", "agent", "auxiliary"]
    assert {t.sampling.temperature for t in trace.turns if t.sampling is not None} == {0.8}  # TRL's, pinned
    assert_trl_trains_our_rows(sequences, trace, agent_turns=3)
    assert completion[-1] == {"role": "assistant", "content": "Done."}


@pytest.mark.slow
def test_an_unscorable_task_is_none_not_zero_through_a_running_proxy(agent_clis: None, trl_loop: Any,
                                                                      exact_engine_url: str, tmp_path: Path) -> None:
    task = tmp_path / "no-reward"
    shutil.copytree(TASKS / "fix-off-by-one", task)
    (task / "tests" / "test.sh").write_text("#!/usr/bin/env bash\necho 'the grader crashed before scoring'\n")
    config = ProxyConfig(upstream=exact_engine_url, store_dir=str(tmp_path / "store"), admin_token="trl-test-token")
    with serve_proxy(config) as running:
        factory = cli_factory(task, "mini-swe-agent", proxy_url=running.url, admin_token="trl-test-token")
        loop = trl_loop(factory, rollout_reward_fn=harbor_style_reward)
        force(exact_engine_url, tools=[tool_call("bash", {"command": SUBMIT})])
        (_, _, sequences, _, _, reward), metrics = loop._run_session(factory.prompt_rows()[0]["prompt"], 0)
        assert reward is None and "correctness" not in metrics  # unscorable: left out of the group baseline
        assert metrics["turns"] == 1 and len(sequences) == 1  # the agent's turn is still captured
        session = loop._factory.create(load_task(task).instruction, seed=1)
        force(exact_engine_url, tools=[tool_call("bash", {"command": SUBMIT})])
        assert session.wait_for_completion() == 0
        verified = session.verify([])
        session.close()
        assert verified.env_reward is None and "neither reward.json nor reward.txt" in verified.artifacts["error"]


@pytest.mark.slow
def test_an_agent_past_its_time_limit_is_flagged_and_still_scored(agent_clis: None, trl_loop: Any,
                                                                   exact_engine_url: str, tmp_path: Path) -> None:
    """TRL's contract: `wait_for_completion` raises TimeoutError, the turns so far are trained and the verifier
    judges the partial work (here 0: the bug is still there). Each forced command sleeps 25 s, under
    mini-swe-agent's own 30 s command limit, so only our 60 s limit can end the run, whenever the agent
    made its first call."""
    factory = cli_factory(TASKS / "fix-off-by-one", "mini-swe-agent", engine_url=exact_engine_url,
                          proxy=ProxyConfig(store_dir=str(tmp_path / "store")))
    factory.rollouts = msgspec.structs.replace(factory.rollouts, agent_timeout_s=60)
    loop = trl_loop(factory)
    force(exact_engine_url, tools=[tool_call("bash", {"command": "sleep 25"})] * 4)
    (_, _, sequences, _, _, reward), metrics = loop._run_session(factory.prompt_rows()[0]["prompt"], 0)
    assert reward == 0.0 and metrics["loop_exhausted"]  # TRL's timed_out
    assert 1 <= metrics["turns"] <= 3 and len(sequences) == 1
    assert_trl_trains_our_rows(sequences, captured(loop), agent_turns=metrics["turns"])


@pytest.mark.slow
def test_closing_a_running_session_stops_its_agent_and_closes_its_capture(agent_clis: None, trl_loop: Any,
                                                                           exact_engine_url: str,
                                                                           tmp_path: Path) -> None:
    """TRL closes in-flight sessions from another thread when it stops: the agent is killed, the capture
    session closed, and the waiting thread gets an exception (TRL scores the rollout empty)."""
    factory = cli_factory(TASKS / "fix-off-by-one", "mini-swe-agent", engine_url=exact_engine_url,
                          proxy=ProxyConfig(store_dir=str(tmp_path / "store")))
    loop = trl_loop(factory)
    runtime = loop._factory._runtime
    force(exact_engine_url, tools=[tool_call("bash", {"command": "sleep 600"})])
    session = loop._factory.create(factory.prompt_rows()[0]["prompt"], seed=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(session.wait_for_completion)
        deadline = time.monotonic() + 240
        while not any(s.turns for s in runtime.loop.run(runtime.client.list_sessions())):
            assert time.monotonic() < deadline and not waiting.done()
            time.sleep(0.5)
        session.close()  # returns once the sandbox and the capture session are released
        (summary,) = runtime.loop.run(runtime.client.list_sessions())
        assert summary.closed and summary.turns == 1
        with pytest.raises(concurrent.futures.CancelledError):
            waiting.result(timeout=60)
    assert session.outcome is None and session.verify([]).env_reward is None


def harbor_style_reward(outcome: Any) -> float | None:
    """The guide's reward shape: None stays None (a module-level function: TRL pickles it into its child)."""
    if outcome.env_reward is None:
        return None
    return outcome.env_reward + (0.3 if outcome.env_reward >= 1.0 else 0.0)
