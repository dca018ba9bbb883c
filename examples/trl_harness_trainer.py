"""TRL's harness trainer on harness-rl sessions: the guide's AsyncGRPO example (TRL 1.16,
`HarnessRolloutWorker` in loop-owning mode) with `HarnessRLSessionFactory` in place of OpenEnv's
`HarborSessionFactory`. TRL trains (FSDP2, its metrics, weight sync into vLLM over NCCL); harness-rl runs
each rollout: the real agent CLI in its sandbox, every model call through our capture proxy, the task's
verifier for the reward. No `openenv harbor serve` and no tunnel: the proxy runs in TRL's rollout process.

On a GPU box with vLLM, e.g. two GPUs, one serving and one training:

    hf download Qwen/Qwen3.5-2B --local-dir models/Qwen3.5-2B
    CUDA_VISIBLE_DEVICES=0 harness-rl serve vllm models/Qwen3.5-2B --served-model-name Qwen/Qwen3.5-2B
    scripts/install_agents.sh                       # the agent CLIs, once
    CUDA_VISIBLE_DEVICES=1 python examples/trl_harness_trainer.py --vllm-url http://127.0.0.1:8000 \\
        --tasks hf://<org>/<harbor-tasks> --harness mini-swe-agent

`harness-rl serve vllm` sets every flag both sides need: token ids and processed logprobs for exact
capture, the tool-call parser, and `VLLM_SERVER_DEV_MODE=1` with NCCL weight transfer for TRL's sync.
`--dry-run` prints the configuration it would train with and exits (CPU is enough; nothing starts).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from adapters.harnesses import HARNESS_NAMES
from adapters.tasks import load_tasks
from harness_rl.integrations.trl import HarnessRLSessionFactory, proxy_sampling
from proxy.config import ProxyConfig

TOOL_CALL_BUDGET = 15  # the guide's efficiency bonus fades to nothing at this many tool calls


def harbor_reward(outcome: Any) -> float | None:
    """The guide's reward: the verifier's score, plus up to 0.3 for solving with few tool calls; the bonus
    only when solved (else doing nothing would look efficient). None stays None: unscorable, never 0."""
    if outcome.env_reward is None:
        return None
    bonus = 0.3 * min(max(1.0 - outcome.tool_call_count / TOOL_CALL_BUDGET, 0.0), 1.0)
    return outcome.env_reward + (bonus if outcome.env_reward >= 1.0 else 0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen3.5-2B",
                        help="the policy, as vLLM serves it (default: %(default)s)")
    parser.add_argument("--vllm-url", required=True,
                        help="the vLLM server TRL syncs weights into and agents sample from")
    parser.add_argument("--tasks", required=True, help="Harbor tasks: a task dir, a dir of them, or hf://<org>/<name>")
    parser.add_argument("--proxy-url", default=None,
                        help="a running `harness-rl serve proxy --upstream VLLM_URL` to capture through (its admin "
                             "token from $HARNESS_RL_ADMIN_TOKEN); default: start one in TRL's rollout process")
    parser.add_argument("--advertise-url", default=None,
                        help="the proxy's URL as sandboxes reach it (cloud sandboxes such as e2b need a public one); "
                             "the started proxy then binds 0.0.0.0")
    parser.add_argument("--harness", default="mini-swe-agent", choices=HARNESS_NAMES)
    parser.add_argument("--sandbox", default="local", choices=("local", "e2b", "harbor"))
    parser.add_argument("--n-tasks", type=int, default=32, help="train on the first N tasks (default: %(default)s)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-inflight", type=int, default=8, help="rollouts running at once")
    parser.add_argument("--max-completion-length", type=int, default=1024, help="tokens per model call")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--agent-timeout", type=float, default=300.0, help="seconds per agent run")
    parser.add_argument("--agent-step-limit", type=int, default=12, help="model calls per agent run")
    parser.add_argument("--output-dir", default="runs/trl-harness")
    parser.add_argument("--report-to", default="trackio")
    parser.add_argument("--dry-run", action="store_true", help="print the configuration it would train with, and exit")
    return parser.parse_args(argv)


def build_factory(args: argparse.Namespace) -> HarnessRLSessionFactory:
    proxy = None
    if args.proxy_url is None and args.advertise_url is not None:
        proxy = ProxyConfig(host="0.0.0.0", advertise_url=args.advertise_url)
    return HarnessRLSessionFactory(
        load_tasks(args.tasks)[:args.n_tasks], engine_url=None if args.proxy_url else args.vllm_url,
        proxy_url=args.proxy_url, proxy=proxy, harness=args.harness, sandbox=args.sandbox,
        max_turns=args.agent_step_limit, max_tokens_per_turn=args.max_completion_length,
        agent_timeout_s=args.agent_timeout, max_concurrent_rollouts=args.max_inflight)


def trainer_config(args: argparse.Namespace) -> dict[str, Any]:
    """`AsyncGRPOConfig`'s arguments, as the guide sets them."""
    return dict(
        output_dir=args.output_dir, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, max_steps=args.max_steps, learning_rate=args.learning_rate,
        temperature=args.temperature, top_p=1.0, top_k=-1, max_staleness=args.max_staleness,
        vllm_server_base_url=args.vllm_url, dtype="bfloat16", gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, save_steps=50, save_total_limit=3,
        chat_template_kwargs={"enable_thinking": False}, report_to=args.report_to, log_completions=False)


def worker_config(args: argparse.Namespace) -> dict[str, Any]:
    """`HarnessRolloutWorker`'s arguments besides the factory, the dataset and the tokenizer (TRL does not pass its
    config's values down to a worker it did not build, so they are given here)."""
    return dict(
        harness_adapter=None, rollout_reward_fn=harbor_reward, model_name=args.model, reward_funcs=[],
        num_generations=args.num_generations, max_inflight_tasks=args.max_inflight, vllm_server_url=args.vllm_url,
        max_tokens=args.max_completion_length, temperature=args.temperature, top_p=1.0, top_k=-1,
        chat_template_kwargs={"enable_thinking": False})


def describe(args: argparse.Namespace, factory: HarnessRLSessionFactory) -> dict[str, Any]:
    """Everything the run would use, as plain data."""
    import msgspec

    # What TRL's worker will hand the factory, and the policy the proxy pins from it.
    trl_sampling = {"temperature": args.temperature, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    policy = proxy_sampling(trl_sampling, factory.proxy.sampling)
    worker = {k: v.__name__ if callable(v) else v for k, v in worker_config(args).items()}
    return {
        "AsyncGRPOConfig": trainer_config(args),
        "HarnessRolloutWorker": {**worker, "dataset": f"{len(factory.tasks)} rows from factory.prompt_rows()",
                                 "processing_class": f"AutoTokenizer.from_pretrained({args.model!r})"},
        "HarnessRLSessionFactory": {
            "tasks": [task.name for task in factory.tasks],
            "capture": {"proxy_url": args.proxy_url} if args.proxy_url else
            {"engine_url": args.vllm_url,
             "proxy": msgspec.to_builtins(msgspec.structs.replace(factory.proxy, sampling=policy))},
            # What each session uses; groups and their order are TRL's.
            "rollouts": {k: v for k, v in msgspec.to_builtins(factory.rollouts).items()
                         if k not in ("tasks", "num_generations", "lockstep")},
            "sampling": {"trl": trl_sampling, "proxy": msgspec.to_builtins(policy)},
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    factory = build_factory(args)
    if args.dry_run:
        json.dump(describe(args, factory), sys.stdout, indent=2)
        print()
        return 0

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.openenv_harness import HarnessRolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # Built from the factory: each row's prompt names its task, and all of a group's rollouts share the row.
    dataset = Dataset.from_list(factory.prompt_rows())
    worker = HarnessRolloutWorker(harness_session_factory=factory, dataset=dataset, processing_class=tokenizer,
                                  **worker_config(args))
    trainer = AsyncGRPOTrainer(model=args.model, args=AsyncGRPOConfig(**trainer_config(args)),
                               processing_class=tokenizer, train_dataset=dataset, rollout_worker=worker)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
