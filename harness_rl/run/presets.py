"""The three presets a run's configuration starts from: `real` (the field defaults), `demo` and `agent`.

A preset is a partial configuration laid over the field defaults, which are those of a real run (a
real model on a real engine). `demo` is the embedded CPU demo (tiny model, `echo` harness, the
`digits` task, short replies, a large learning rate); `agent` is the CPU agent demo (`tiny-agent`,
mini-swe-agent on the shipped agent tasks). A demo preset applies only when asked for with
`--preset`, or when no preset is named and the model is one harness-rl builds, so a demo value never
reaches a real run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO_TASK = EXAMPLES / "tasks" / "digits"
AGENT_TASKS = EXAMPLES / "agent-tasks"
Preset = Literal["demo", "agent", "real"]

# A reply without a tool call ends the agent demo's rollout: mini-swe-agent drops such a reply from its history,
# so the turn after it could not continue its tokens (README, "The agent demo").
# mini-swe-agent's own task prompt is about 1,100 tokens of workflow advice with the task at its top; a 0.8M-parameter
# model cannot look that far back for the names it must copy, so the demo gives it the task and the rules alone.
AGENT_INSTANCE_TEMPLATE = ("{{task}}\n\nRun one bash command per reply. When the task is done, run "
                           "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` alone.")
AGENT_HARNESS_OPTIONS: dict[str, Any] = {"step_limit": 6, "max_consecutive_format_errors": 1,
                                         "instance_template": AGENT_INSTANCE_TEMPLATE}

PRESETS: dict[str, dict[str, Any]] = {
    "real": {},
    "demo": {
        "engine": {"model": "tiny", "batch_invariant": True},
        "rollouts": {"harness": "echo", "tasks": str(DEMO_TASK), "max_tokens_per_turn": 16, "lockstep": True},
        "learner": {"learning_rate": 1e-2, "max_steps": 40},
    },
    # Measured on a loaded 2-core box (docs/demo.md, "The agent demo"): every rollout starts mini-swe-agent (about
    # 5 CPU-seconds, most of it importing litellm), so the run is short: 8 steps of 4 tasks x 4 rollouts. The
    # tasks are four families of equal size, so each step holds about one task of each (`task_order`; groups are
    # handed over as they finish), and the reward of the first steps and of the last compares the same kinds.
    "agent": {
        "engine": {"model": "tiny-agent"},
        "rollouts": {"harness": "mini-swe-agent", "tasks": str(AGENT_TASKS / "train"), "max_tokens_per_turn": 64,
                     "num_generations": 4, "max_concurrent_rollouts": 4, "harness_options": AGENT_HARNESS_OPTIONS},
        "learner": {"learning_rate": 1e-3, "max_steps": 8, "groups_per_step": 4,
                    "loss": {"normalization": "rollout"}},
    },
}
# Models harness-rl builds offline (`harness-rl build-model`), and the preset each one implies.
PRESET_FOR_MODEL: dict[str, Preset] = {"tiny": "demo", "tiny-agent": "agent"}
BUILT_MODELS = tuple(PRESET_FOR_MODEL)
