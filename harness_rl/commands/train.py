"""`harness-rl train`: GRPO on real agent rollouts. With no flags, the embedded CPU demo."""

from __future__ import annotations

import argparse
from typing import Any

# (flag, setting, type, help); every setting also has a name in `--config FILE` (TOML or JSON).
FLAGS: list[tuple[str, str, Any, str]] = [
    ("--harness", "harness", str, "agent CLI by Harbor's name: echo (default), codex, … (harness-rl harnesses)"),
    ("--tasks", "tasks", str, "a Harbor task dir, a dir of them, or hf://<dataset repo> (default: the digits demo)"),
    ("--model", "model", str, "tiny (default, built offline), a local model dir, or a hub id with --engine URL"),
    ("--engine", "engine", str, "embedded (default) or the URL of a running engine (vLLM or harness-rl)"),
    ("--weight-sync", "weight_sync", str, "auto (default), inprocess, http, nccl or none"),
    ("--sandbox", "sandbox", str, "local (default), e2b or harbor"),
    ("--num-generations", "num_generations", int, "rollouts per task in a GRPO group (default 8)"),
    ("--max-concurrent-rollouts", "max_concurrent_rollouts", int, "agents running at once (default 8)"),
    ("--groups-per-step", "groups_per_step", int, "groups per optimizer step (default 1)"),
    ("--max-steps", "max_steps", int, "optimizer steps (default 40)"),
    ("--learning-rate", "learning_rate", float, "AdamW learning rate (default 1e-2 for tiny, else 1e-6)"),
    ("--lr-scheduler", "lr_scheduler", str, "constant (default), linear or cosine"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps (default 0)"),
    ("--max-staleness", "max_staleness", int, "drop tokens sampled more than N policy versions ago (default 4)"),
    ("--temperature", "temperature", float, "sampling temperature pinned at the proxy (default 1.0)"),
    ("--max-tokens-per-turn", "max_tokens_per_turn", int, "cap on each model call's max_tokens (default 16)"),
    ("--max-turns", "max_turns", int, "model calls per rollout before the proxy stops the agent (default 32)"),
    ("--agent-timeout", "agent_timeout_s", float, "seconds before an agent is killed (default: the task's)"),
    ("--reward-key", "reward_key", str, "which key of the verifier's reward.json is the reward"),
    ("--token-budget", "token_budget", int, "tokens per packed micro-batch (default 16384)"),
    ("--epsilon", "epsilon", float, "lower clip of the ratio (default 0.2)"),
    ("--epsilon-high", "epsilon_high", float, "upper clip of the ratio (default: epsilon)"),
    ("--beta", "beta", float, "k3 KL weight to the initial model (default 0)"),
    ("--loss-normalization", "loss_normalization", str, "token (default) or rollout"),
    ("--output-dir", "output_dir", str, "where metrics, checkpoints, traces, plot and summary go"),
    ("--save-every", "save_every", int, "checkpoint every N steps (default 10; 0 = only at the end)"),
    ("--seed", "seed", int, "seed for the tiny model, sampling and the learner (default 0)"),
    ("--proxy-host", "proxy_host", str, "proxy bind address (default 127.0.0.1)"),
    ("--proxy-port", "proxy_port", int, "proxy port (default: a free one)"),
    ("--advertise-url", "advertise_url", str, "proxy URL handed to agents (needed for cloud sandboxes)"),
]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train", help="train with GRPO on real agent rollouts (no flags: the embedded CPU demo)",
        description="Run agents on tasks through the capture proxy, score them with each task's verifier, and "
                    "train with GRPO; new weights go back into the engine after every step.",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="TOML or JSON file of settings; flags override it")
    for flag, dest, kind, text in FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, help=text)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    parser.add_argument("--clip-to-behaviour", dest="decoupled", action="store_false",
                        help="clip the ratio to the sampling policy (TRL AsyncGRPO) instead of decoupled PPO")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="trade compute for activation memory")
    parser.set_defaults(run=run)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    import signal

    from harness_rl.train import TrainConfig, TrainConfigError, load_config_file, train

    signal.signal(signal.SIGTERM, _interrupt)  # a job scheduler's stop is handled like Ctrl-C

    settings = vars(args).copy()
    for key in ("run", "command"):
        settings.pop(key, None)
    try:
        config_file = settings.pop("config", None)
        merged = load_config_file(config_file) if config_file else {}
        merged.update(settings)
        if merged.get("resume") and not merged.get("output_dir"):
            raise TrainConfigError("--resume needs --output-dir (the run to continue)")
        train(TrainConfig(**merged))
    except TrainConfigError as exc:
        raise SystemExit(f"harness-rl train: {exc}") from None
    except KeyboardInterrupt:
        print("harness-rl train: interrupted; rollouts and sessions closed, last checkpoint kept")
        return 130
    return 0
