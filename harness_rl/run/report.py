"""The end of a run: a reward/loss plot and a summary, both read back from `metrics.jsonl`.

Rewards are means over scored rollouts: a step with none scored has no reward (no point on the plot, not
a 0), and the summary counts the scored and unscorable rollouts of the whole run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

WINDOW = 3  # steps averaged at each end of the run for the headline reward change


def read_metrics(output_dir: Path) -> list[dict[str, float]]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict[str, float]], *, duration_s: float) -> dict[str, Any]:
    rewards = [row["reward"] for row in rows if "reward" in row]
    later = sum(row.get("rollout/later_turns", 0.0) for row in rows)
    return {
        "steps": int(rows[-1]["step"]) if rows else 0,
        "duration_s": round(duration_s, 1),
        "reward_first_steps": _mean(rewards[:WINDOW]),
        "reward_last_steps": _mean(rewards[-WINDOW:]),
        "reward_window_steps": WINDOW,
        "rollouts_scored": int(sum(row.get("rollouts/scored", 0.0) for row in rows)),
        "rollouts_unscorable": int(sum(row.get("rollouts/unscorable", 0.0) for row in rows)),
        "loss_last": rows[-1].get("loss") if rows else None,
        # agent turns after each rollout's first that chained onto the one before (harness_rl.trace.stats)
        "chained_turns_share": sum(row.get("rollout/chained_turns", 0.0) for row in rows) / later if later else None,
        "policy_version": int(rows[-1]["policy_version"]) if rows and "policy_version" in rows[-1] else 0,
    }


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for axis, key in ((top, "reward"), (bottom, "loss")):
        points = [(row["step"], row[key]) for row in rows if key in row]
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", markersize=3)
        axis.set_ylabel(key)
        axis.grid(alpha=0.3)
    bottom.set_xlabel("step")
    top.set_title("harness-rl: mean group reward and GRPO loss per step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_report(output_dir: Path, *, started: float, stopped: str | None = None) -> dict[str, Any]:
    """Write `training.png` and `summary.json`, print the summary, and return it. `stopped` says why a run
    ended before `max_steps` (interrupted, or the reason it could not go on)."""
    rows = read_metrics(output_dir)
    summary = summarize(rows, duration_s=time.time() - started)
    summary["stopped"] = stopped
    if rows:
        plot(rows, output_dir / "training.png")
        summary["plot"] = str(output_dir / "training.png")
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    first, last = summary["reward_first_steps"], summary["reward_last_steps"]
    scored = first is not None and last is not None
    change = f"{first:.3f} -> {last:.3f}" if scored else "n/a (no step scored a rollout)"
    chained = summary["chained_turns_share"]
    chain = f"; {chained:.1%} of later agent turns chained" if chained is not None else ""
    unscorable, rollouts = summary["rollouts_unscorable"], summary["rollouts_scored"] + summary["rollouts_unscorable"]
    lost = f"; {unscorable} of {rollouts} rollouts unscorable (rollouts.jsonl says why)" if unscorable else ""
    ended = "done" if stopped is None else "stopped"
    print(f"{ended}: {summary['steps']} steps in {summary['duration_s']:.0f}s; mean reward over the first/last "
          f"{WINDOW} steps {change}{lost}{chain}; outputs in {output_dir}")
    return summary
